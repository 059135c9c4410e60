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
``Messages`` every message, ``Unacked`` in flight (delivered, held by a consumer's
visibility timeout), ``Ready`` visible now, ``Delayed`` not visible yet and never
delivered (Celery countdown/ETA, ``x-delay``), so Messages = Unacked + Ready + Delayed;
``Consumers`` live kombu_pgmq consumers. The Delayed column is added to Flower's own
``broker.html`` for kombu_pgmq brokers only (if a Flower release changes that page so
the column cannot be placed, the page is Flower's, without it). ``/api/queues/length``
returns the same keys (``messages``, ``messages_unacknowledged``, ``messages_ready``,
``delayed``, ``consumers``). Flower 2 serves its API, ``/api/queues/length`` included,
only with authentication (``--basic_auth``, ``--auth``) or with
``FLOWER_UNAUTHENTICATED_API=true`` in its environment; otherwise it answers 401 (its
pages do not need that). Needs ``pip install 'kombu-pgmq-transport[flower]'``.
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
from pathlib import Path
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


#: Name of the Broker page's template with the Delayed column (never a file; no "/": the
#: name resolves "base.html" in the same directory).
BROKER_TEMPLATE = "kombu_pgmq_broker.html"
_READY_HEADER = "<th>Ready</th>"
_READY_CELL = "<td>{% raw format_value(queue.get('messages_ready')) %}</td>"
_templates: dict[str, Any] = {}


@functools.cache
def broker_template_source() -> str | None:
    """Flower's ``broker.html`` with a ``Delayed`` column after ``Ready`` (the row's
    ``delayed``) and the empty table's ``colspan`` one wider; None when this Flower's
    page lacks the one Ready header and cell the column goes after."""
    import flower

    source = (Path(flower.__file__).parent / "templates" / "broker.html").read_text()
    if source.count(_READY_HEADER) != 1 or source.count(_READY_CELL) != 1:
        return None
    source = source.replace(_READY_HEADER, _READY_HEADER + "\n          <th>Delayed</th>")
    delayed = "<td>{% raw format_value(queue.get('delayed')) %}</td>"
    source = source.replace(_READY_CELL, _READY_CELL + "\n          " + delayed)
    columns = len(re.findall(r"<th[ >]", source))
    return source.replace(f'colspan="{columns - 1}"', f'colspan="{columns}"')


def _broker_template(handler: Any) -> Any:
    """:data:`BROKER_TEMPLATE` compiled once per template directory, with a loader of
    Flower's templates (``base.html``, ``navbar.html``)."""
    from tornado.template import Template

    path = handler.get_template_path()
    with _lock:
        if path not in _templates:
            loader = handler.create_template_loader(path)
            _templates[path] = Template(
                broker_template_source() or "", name=BROKER_TEMPLATE, loader=loader
            )
        return _templates[path]


def enable() -> None:
    """Make Flower's ``get_broker`` answer ``postgresql://`` and ``postgres://`` broker
    URLs with :class:`PgmqBroker`; other brokers keep Flower's own classes. Idempotent;
    call it before Flower serves requests (importing this module does)."""
    global _enabled
    with _lock:
        if _enabled:
            return
        from flower.views import BaseHandler
        from flower.views.broker import BrokerView

        original = BaseHandler.get_broker
        original_render_string = BrokerView.render_string

        def get_broker(self: Any) -> Any:
            app = self.application
            url = _configured_url(self.capp, app.broker_uri_with_password)
            if url.split("://", 1)[0].split("+", 1)[0] in SCHEMES:
                self._kombu_pgmq_broker = True  # the Broker page gets the Delayed column
                return PgmqBroker(url, broker_options=self.capp.conf.broker_transport_options)
            return original(self)

        def render_string(self: Any, template_name: str, **kwargs: Any) -> bytes:
            if (
                template_name == "broker.html"
                and getattr(self, "_kombu_pgmq_broker", False)
                and broker_template_source() is not None
            ):
                namespace = self.get_template_namespace()
                namespace.update(kwargs)
                return bytes(_broker_template(self).generate(**namespace))
            return bytes(original_render_string(self, template_name, **kwargs))

        BaseHandler.get_broker = get_broker
        BrokerView.render_string = render_string
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
