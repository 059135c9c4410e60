"""The poller's recovery from a lost statement connection or a cancelled statement, in
Celery's event loop and ``drain_events`` (a base of :class:`~kombu_pgmq.transport.poller.
Poller`): held messages are kept, and reads are retried."""

from __future__ import annotations

import contextlib
import logging
from time import monotonic
from typing import Any

from .. import errors
from ._handover import Handover

__all__ = ["RECONNECT_SECONDS", "Recovery"]

logger = logging.getLogger("kombu_pgmq.transport.poller")

#: Seconds between reconnection attempts of a consumer in Celery's event loop: a restarted
#: or promoted server is found within a second; an attempt while it is down is refused at
#: once.
RECONNECT_SECONDS = 1.0


class Recovery:
    """Connection loss and cancelled statements (a base of the poller)."""

    handover: Handover
    _connection_lost_at: float | None
    _canceled_at: float | None
    _retry_pending: bool
    _next_fallback: float
    _waiting: set[str]
    _ready: set[str]
    _hub: Any

    @property
    def polling_interval(self) -> float:
        raise NotImplementedError

    def consumed(self) -> set[str]:
        raise NotImplementedError

    def _on_hub_fallback(self) -> None:
        raise NotImplementedError

    def _connection_lost(self, exc: BaseException) -> None:
        """The statement connection was lost in the event loop: keep every held message
        (leases renew once reconnected) and retry soon, instead of making Celery restart
        its consumer (which would requeue the running tasks)."""
        if self._connection_lost_at is None:
            self._connection_lost_at = monotonic()
            logger.warning(
                "database connection lost (%s); reconnecting every %.1f s, held messages are kept",
                exc,
                self.polling_interval,
            )
        self._waiting.clear()  # recorded again as queues are found empty
        self.handover.armed.clear()
        with contextlib.suppress(errors.KombuPgmqError):
            self._ready |= self.consumed()
        if self._hub is not None and not self._retry_pending:
            # retry soon, not at the next fallback poll only; one timer at a time
            self._retry_pending = True
            self._hub.call_later(RECONNECT_SECONDS, self._on_hub_retry)

    def _on_hub_retry(self) -> None:
        self._retry_pending = False
        self._on_hub_fallback()

    def _connection_ok(self) -> None:
        if self._connection_lost_at is not None:
            logger.warning(
                "database connection re-established after %.1f s",
                monotonic() - self._connection_lost_at,
            )
            self._connection_lost_at = None
        if self._canceled_at is not None:
            logger.warning("reads work again after %.1f s", monotonic() - self._canceled_at)
            self._canceled_at = None

    def _statement_canceled(self, exc: errors.StatementCanceled) -> None:
        """A read or ack was cancelled (``statement_timeout`` ran out, e.g. behind a lock
        an open transaction holds on a queue table, or ``pg_cancel_backend``): nothing was
        applied (the acks are kept) and the connection is fine. Not a lost connection:
        keep it and every held message, try again at the next fallback poll."""
        if self._canceled_at is None:
            self._canceled_at = monotonic()
            logger.warning(
                "reading the consumed queues failed: %s; trying again every %.1f s, held "
                "messages are kept",
                exc,
                self.polling_interval,
            )
        self._next_fallback = monotonic() + self.polling_interval
