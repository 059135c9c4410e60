"""What a transport caches of the database's topology: each Kombu queue's priority bands
(:mod:`kombu_pgmq._priorities`), the routing table of exchanges and bindings
(:mod:`._routing`), and which queues got their ``queue_limits`` (:mod:`kombu_pgmq.limits`).
One per transport, shared by its channels; loaded on first use through the transport's
statement connection."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .. import _priorities as priorities
from .._db.broker import Broker
from .._db.limits import LimitStore
from .._naming import pgmq_queue_name
from .._priorities import Bands
from ..errors import PermissionDenied
from ._routing import Routes

logger = logging.getLogger(__name__)

__all__ = ["Topology"]


class Topology:
    """Bands and routes as stored (see the module docstring).

    ``broker``: returns the transport's statement-connection broker (connecting if needed).
    """

    def __init__(self, broker: Callable[[], Broker]) -> None:
        self._broker = broker
        self._routes: Routes | None = None
        self._bands: dict[str, Bands] = {}  # Kombu queue -> priority bands, as stored
        self._limits_set: set[str] = set()  # Kombu queues given their queue_limits
        #: Kombu queue -> declared without x-deduplicate-task-id (as stored)
        self._plain: dict[str, bool] = {}

    @property
    def routes_loaded(self) -> bool:
        """Whether the routing table is cached (False until the first :meth:`routes`)."""
        return self._routes is not None

    def bands(self, queue: str) -> Bands:
        """Priority bands of Kombu queue ``queue`` as stored in the database (cached; a
        queue without x-max-priority, or unknown yet, has one band: its PGMQ queue)."""
        bands = self._bands.get(queue)
        if bands is None:
            name = pgmq_queue_name(queue)
            info = self._broker().declarations.queue_info(queue)
            if info is None:  # not declared yet: ask again next time
                return priorities.single(name)
            bands = self._bands[queue] = priorities.stored(name, info.floors, info.band_queues)
            # the same row: no second query for plain()
            self._plain.setdefault(queue, not info.deduplicate_task_id)
        return bands

    def known_bands(self, queue: str) -> Bands:
        """:meth:`bands` as cached, without a query (for threads that must not reopen a
        closed connection)."""
        return self._bands.get(queue) or priorities.single(pgmq_queue_name(queue))

    def set_bands(self, queue: str, bands: Bands) -> None:
        """Record ``queue``'s bands as declared."""
        self._bands[queue] = bands

    def set_limits(self, queue: str, limits: Mapping[str, Any]) -> None:
        """Give Kombu queue ``queue`` the ``limits`` of transport option ``queue_limits``
        (the whole set: limits not named are removed), once per transport; a role without
        the privilege (a producer) leaves them to the workers (logged)."""
        if queue in self._limits_set:
            return
        try:
            LimitStore(self._broker().db).set(queue, limits, replace=True)
        except PermissionDenied as exc:
            logger.warning(
                "queue_limits of queue %r not set: %s (a worker role sets them when it "
                "declares the queue)",
                queue,
                exc,
            )
        self._limits_set.add(queue)

    def plain(self, queue: str) -> bool:
        """Whether Kombu queue ``queue`` was declared without ``x-deduplicate-task-id``
        (its messages need no deduplication check unless they carry an
        ``x-deduplication-id``). As declared by any channel of this transport, else as
        stored (one query per queue and transport; fixed at a queue's first declaration,
        changed only by a delete). False for a queue not declared yet (asked again next
        time)."""
        plain = self._plain.get(queue)
        if plain is None:
            info = self._broker().declarations.queue_info(queue)
            if info is None:
                return False
            plain = self._plain[queue] = not info.deduplicate_task_id
            if queue not in self._bands:  # the same row: no second query for bands()
                name = pgmq_queue_name(queue)
                self._bands[queue] = priorities.stored(name, info.floors, info.band_queues)
        return plain

    def set_plain(self, queue: str, plain: bool) -> None:
        """Record whether ``queue`` was declared without ``x-deduplicate-task-id``."""
        self._plain[queue] = plain

    def forget_bands(self, queue: str) -> None:
        """Forget ``queue``'s cached bands and deduplication setting (dropped or
        redeclared): read again on next use (and its ``queue_limits`` set again when it
        is declared again)."""
        self._bands.pop(queue, None)
        self._plain.pop(queue, None)
        self._limits_set.discard(queue)

    def routes(self) -> Routes:
        """The cached routing table (loaded on first use; see :mod:`._routing`)."""
        routes = self._routes
        if routes is None:
            routes = self.reload_routes()
        return routes

    def reload_routes(self) -> Routes:
        """Load the routing table (and every queue's bands with it) in one statement."""
        table = self._broker().declarations.routing_table()
        for queue, (floors, queues) in table.bands.items():
            self._bands[queue] = priorities.stored(pgmq_queue_name(queue), floors, queues)
        routes = self._routes = Routes(table)
        return routes
