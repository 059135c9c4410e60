"""The poller's reads of queues whose delayed message becomes due (a base of
:class:`~kombu_pgmq.transport.poller.Poller`): the earliest due time per PGMQ queue,
learned from ``kombu_pgmq.wait_for_due`` and from NOTIFY payloads, and
one timer of Celery's event loop at the earliest of them."""

from __future__ import annotations

import contextlib
from time import monotonic
from typing import Any

__all__ = ["DueReads"]


class DueReads:
    """Due times of delayed messages and their event-loop timer (a base of the poller)."""

    _due: dict[str, float]
    _due_timer: Any
    _hub: Any

    def _on_hub_event(self) -> None:
        raise NotImplementedError

    def _due_at(self, name: str, deadline: float) -> None:
        """Read queue ``name`` at ``deadline`` (monotonic; the earliest one wins)."""
        current = self._due.get(name)
        if current is None or deadline < current:
            self._due[name] = deadline

    def _schedule_due(self) -> None:
        """In Celery's event loop: one timer, at the earliest due time."""
        if self._hub is None:
            return
        earliest = min(self._due.values(), default=None)
        timer = self._due_timer
        if timer is not None:
            if earliest is not None and timer[0] <= earliest:
                return  # an earlier (or the same) read is scheduled already
            with contextlib.suppress(Exception):
                timer[1].cancel()
            self._due_timer = None
        if earliest is not None:
            entry = self._hub.call_later(max(0.0, earliest - monotonic()), self._on_hub_due)
            self._due_timer = (earliest, entry)

    def _on_hub_due(self) -> None:
        self._due_timer = None
        self._on_hub_event()
