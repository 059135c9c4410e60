"""What a transport caches of the database's topology: each Kombu queue's priority bands
(:mod:`kombu_pgmq._priorities`), which PGMQ queues are FIFO (``x-fifo-groups``), and the
routing table of exchanges and bindings (:mod:`._routing`). One per transport, shared by
its channels; loaded on first use through the transport's statement connection."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .. import _priorities as priorities
from .._db.broker import Broker
from .._naming import pgmq_queue_name
from .._priorities import Bands
from ._routing import Routes

__all__ = ["Topology"]


class Topology:
    """Bands, FIFO queues and routes as stored (see the module docstring).

    ``broker``: returns the transport's statement-connection broker (connecting if needed).
    """

    def __init__(self, broker: Callable[[], Broker]) -> None:
        self._broker = broker
        self._routes: Routes | None = None
        self._bands: dict[str, Bands] = {}  # Kombu queue -> priority bands, as stored
        self._fifo: set[str] = set()  # PGMQ names of FIFO queues (x-fifo-groups), as stored

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
            info = self._broker().queue_info(queue)
            if info is None:  # not declared yet: ask again next time
                return priorities.single(name)
            bands = self._bands[queue] = priorities.stored(name, info.floors, info.band_queues)
            if info.fifo_groups:
                self._fifo.add(name)
        return bands

    def known_bands(self, queue: str) -> Bands:
        """:meth:`bands` as cached, without a query (for threads that must not reopen a
        closed connection)."""
        return self._bands.get(queue) or priorities.single(pgmq_queue_name(queue))

    def set_bands(self, queue: str, bands: Bands, *, fifo: bool = False) -> None:
        """Record ``queue``'s bands as declared (and whether its PGMQ queues are FIFO)."""
        self._bands[queue] = bands
        if fifo:
            self._fifo.update(bands.queues)
        else:
            self._fifo.difference_update(bands.queues)

    def fifo_queues(self, names: Iterable[str]) -> list[str]:
        """The FIFO queues (``x-fifo-groups``, as stored) among PGMQ queue ``names``."""
        fifo = self._fifo
        return [n for n in names if n in fifo] if fifo else []

    def forget_bands(self, queue: str) -> None:
        """Forget ``queue``'s cached bands (dropped or redeclared): read again on next use."""
        self._bands.pop(queue, None)

    def routes(self) -> Routes:
        """The cached routing table (loaded on first use; see :mod:`._routing`)."""
        routes = self._routes
        if routes is None:
            routes = self.reload_routes()
        return routes

    def reload_routes(self) -> Routes:
        """Load the routing table (and every queue's bands with it) in one statement."""
        table = self._broker().routing_table()
        for queue, (floors, queues) in table.bands.items():
            self._bands[queue] = priorities.stored(pgmq_queue_name(queue), floors, queues)
        routes = self._routes = Routes(table)
        return routes
