"""The application's own connection as a connector (:func:`kombu_pgmq.using`: publishes
inside the application's transaction)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import psycopg

from ..errors import KombuPgmqError, StaleDelivery, TransactionError, translate
from .connector import _LIVE, Connector

__all__ = ["STALE_DELIVERY", "ExternalConnector"]

#: SQLSTATE of kombu_pgmq.ack_in_transaction's fence (a receipt no longer held).
STALE_DELIVERY = "KP001"


class ExternalConnector(Connector):
    """Statements on a connection the application owns, inside its transaction
    (:func:`kombu_pgmq.using`): never connects, reconnects, commits, closes or changes
    its settings; a failure is a :class:`~kombu_pgmq.errors.TransactionError` (the
    application's transaction is what failed: kombu must not retry it elsewhere).

    Arguments:
        connection: an open psycopg 3 connection of the application.
    """

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        super().__init__("")
        # Weak: kombu_pgmq must not keep the application's connection alive.
        self._ref: Callable[[], psycopg.Connection[Any] | None] = weakref.ref(connection)
        _LIVE.discard(self)  # the application's: a fork leaves it to the application

    def __repr__(self) -> str:
        conn = self._ref()
        return f"<ExternalConnector {'closed' if conn is None or conn.closed else 'open'}>"

    @property
    def connection(self) -> psycopg.Connection[Any]:
        conn = self._ref()
        if conn is None or conn.closed or self._pid != os.getpid():
            raise TransactionError(
                "the application's connection given to kombu_pgmq.using() is closed (or "
                "belongs to another process): publish through an open connection"
            )
        return conn

    def _connect(self) -> psycopg.Connection[Any]:  # pragma: no cover - never connects
        return self.connection

    def _commit_mode(self, conn: psycopg.Connection[Any], synchronous: bool | None) -> None:
        """The application's transaction commits as the application says: no change."""

    def close(self) -> None:
        """Forget the application's connection (it stays open: it is not ours)."""
        self._ref = lambda: None

    def _fail(self, exc: psycopg.Error) -> KombuPgmqError:
        if getattr(exc, "sqlstate", None) == STALE_DELIVERY:
            diag = exc.diag
            return StaleDelivery(f"{diag.message_primary}: {diag.message_hint}")
        return TransactionError(
            f"a statement in the application's transaction failed: {translate(exc)}; the "
            "transaction is aborted (PostgreSQL rolls it back): roll back and try it again"
        )
