"""Flower's Broker page and ``/api/queues/length`` for kombu_pgmq queues.

Flower (2.x) shows queue lengths only for the brokers it knows, chosen by the URL scheme
in ``flower/utils/broker.py`` (``amqp``, ``redis``, ...): there is no plugin hook, so for
``postgresql://`` it answers ``'postgresql' broker is not supported``. :func:`enable`
adds kombu_pgmq to that choice; the lengths come from
:meth:`kombu_pgmq.management.Management.queues` (one statement per page load).

**Enable it** (one line), either run Flower through this module instead of ``celery``
(same arguments)::

    python -m kombu_pgmq.flower -A proj flower --port=5555

or, with your own Flower config file (``flowerconfig.py`` in the working directory, or
``--conf=FILE``; Flower runs it as Python), add::

    import kombu_pgmq.flower  # noqa: F401  (Flower's Broker page for postgresql://)

The Broker page's columns, per queue the workers consume (as Flower lists them):
``Messages`` every message (ready + in flight + delayed), ``Unacked`` in flight
(delivered, held by a consumer's visibility timeout), ``Ready`` visible now,
``Consumers`` live kombu_pgmq consumers. ``/api/queues/length`` returns the same keys
(``messages``, ``messages_unacknowledged``, ``messages_ready``, ``consumers``) plus
``delayed``. Needs ``pip install 'kombu-pgmq-transport[flower]'``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from flower.utils.broker import BrokerBase

from ._conninfo import SCHEMES
from .dlq import DEFAULT_DEAD_LETTER_QUEUE
from .management import Management, QueueStats

__all__ = ["PgmqBroker", "enable"]

_enabled = False
_lock = threading.Lock()


class PgmqBroker(BrokerBase):
    """Flower's broker interface (``async queues(names) -> [dict]``) over
    :class:`~kombu_pgmq.management.Management`: one connection per broker URL, shared by
    Flower's requests (statistics run in a thread, not on Flower's event loop).

    Arguments:
        broker_url: the Celery app's broker URL (a failover list's first URL is used).
        broker_options: the app's ``broker_transport_options`` (``dead_letter_queue``).
    """

    _shared: dict[tuple[str, str], tuple[Management, threading.Lock]] = {}

    def __init__(self, broker_url: str, *_: Any, broker_options: Any = None, **__: Any) -> None:
        # BrokerBase.__init__ would parse host/port with urllib, which a multi-host or
        # socket-directory URL breaks; Flower uses only queues().
        self.url = broker_url.split(";", 1)[0].strip()
        options = broker_options or {}
        self.dead_letter_queue = str(options.get("dead_letter_queue") or DEFAULT_DEAD_LETTER_QUEUE)

    def _management(self) -> tuple[Management, threading.Lock]:
        key = (self.url, self.dead_letter_queue)
        with _lock:
            if key not in self._shared:
                management = Management(self.url, dead_letter_queue=self.dead_letter_queue)
                self._shared[key] = (management, threading.Lock())
            return self._shared[key]

    def _stats(self) -> dict[str, QueueStats]:
        management, lock = self._management()
        with lock:
            return {q.name: q for q in management.queues()}

    async def queues(self, names: list[str]) -> list[dict[str, Any]]:
        """One dict per queue name, in ``names`` order: ``name``, ``messages``,
        ``messages_ready``, ``messages_unacknowledged``, ``delayed``, ``consumers``,
        ``idle_since`` (None); a queue that does not exist yet counts 0.

        Raises:
            KombuPgmqError: the database cannot be read (Flower logs it and shows an
                empty table on the Broker page).
        """
        stats = await asyncio.get_running_loop().run_in_executor(None, self._stats)
        rows = []
        for name in names:
            q = stats.get(name)
            rows.append(
                {
                    "name": name,
                    "messages": q.messages if q else 0,
                    "messages_ready": q.ready if q else 0,
                    "messages_unacknowledged": q.in_flight if q else 0,
                    "delayed": q.delayed if q else 0,
                    "consumers": q.consumers if q else 0,
                    "idle_since": None,
                }
            )
        return rows


def _configured_url(capp: Any, fallback: str) -> str:
    """The Celery app's broker URL as configured (Flower's own copy, rebuilt by kombu's
    ``as_uri``, drops libpq query parameters such as ``host=/socket/dir``)."""
    url = capp.conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    return str(url) if url else fallback


def enable() -> None:
    """Make Flower's ``get_broker`` answer ``postgresql://`` and ``postgres://`` broker
    URLs with :class:`PgmqBroker`; other brokers keep Flower's own classes. Idempotent;
    call it before Flower serves requests (importing this module does)."""
    global _enabled
    with _lock:
        if _enabled:
            return
        from flower.views import BaseHandler

        original = BaseHandler.get_broker

        def get_broker(self: Any) -> Any:
            app = self.application
            url = _configured_url(self.capp, app.broker_uri_with_password)
            if url.split("://", 1)[0].split("+", 1)[0] in SCHEMES:
                return PgmqBroker(url, broker_options=self.capp.conf.broker_transport_options)
            return original(self)

        BaseHandler.get_broker = get_broker
        _enabled = True


def main(argv: list[str] | None = None) -> None:
    """``python -m kombu_pgmq.flower ARGS``: ``celery ARGS`` with :func:`enable` applied
    (e.g. ``-A proj flower --port=5555``)."""
    import sys

    import kombu_pgmq  # noqa: F401  (postgresql:// is this transport)

    enable()
    from celery.bin.celery import main as celery_main

    sys.argv = ["celery", *(sys.argv[1:] if argv is None else argv)]
    celery_main()


enable()

if __name__ == "__main__":  # pragma: no cover
    main()
