"""Prometheus metrics (prometheus-client): queue depths from the database, and this
process's transport counters.

**Serve them** (one statement per scrape, whatever the number of queues)::

    kombu-pgmq metrics serve --url postgresql://user@db/app --port 9808

**Or add them to an application's own registry**::

    from prometheus_client import REGISTRY
    from kombu_pgmq.metrics import ProcessCollector, QueueCollector

    REGISTRY.register(QueueCollector("postgresql://user@db/app"))  # queue depths
    REGISTRY.register(ProcessCollector())  # this process's counters

Queue metrics (:class:`QueueCollector`; gauges, per Kombu queue with its priority bands
summed; see :mod:`kombu_pgmq.management` for the states):

==============================================  =========================================
``kombu_pgmq_queue_messages{queue,state}``       messages; ``state``: ``ready``,
                                                 ``in_flight``, ``delayed``
``kombu_pgmq_queue_band_messages{queue,band,state}``  the same per priority band (floor
                                                 ``band``), for queues with priorities
``kombu_pgmq_queue_oldest_message_age_seconds``  age since publish of the oldest ready or
                                                 in-flight message (0: none)
``kombu_pgmq_dead_letters{queue}``               dead-letter queue messages from ``queue``
``kombu_pgmq_archive_messages{queue}``           archived (acked, cancelled) messages;
                                                 PostgreSQL's estimate above 100,000
``kombu_pgmq_consumers{queue}``                  live consumers (heartbeat not stale)
``kombu_pgmq_queue_paused{queue}``               1 while ``kombu-pgmq queue pause``-d
``kombu_pgmq_up``                                1 if the last scrape reached the database
``kombu_pgmq_scrape_duration_seconds``           time the statistics statement took
==============================================  =========================================

Process metrics (:class:`ProcessCollector`; counters of the transport in this process,
from :mod:`kombu_pgmq._stats`): ``kombu_pgmq_deliveries_total``,
``kombu_pgmq_redeliveries_total`` (``read_ct`` > 1), ``kombu_pgmq_acks_total``,
``kombu_pgmq_rejects_total``, ``kombu_pgmq_requeues_total`` (rejects with requeue),
``kombu_pgmq_dead_lettered_total``, ``kombu_pgmq_lease_renewals_total``,
``kombu_pgmq_lost_leases_total``, ``kombu_pgmq_publishes_total``,
``kombu_pgmq_publish_errors_total``. In a Celery worker (prefork), deliveries, acks and
leases happen in the main process: export from there, e.g. on ``worker_init``::

    from celery.signals import worker_init

    @worker_init.connect
    def metrics(**_):
        from prometheus_client import REGISTRY, start_http_server
        REGISTRY.register(ProcessCollector())
        start_http_server(9809)

The database role needs the statistics function: the owner, or a role granted with
``kombu-pgmq schema grant producer ROLE`` (it sees counts, not messages).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from . import errors
from ._stats import FIELDS, STATS
from .dlq import DEFAULT_DEAD_LETTER_QUEUE
from .management import EXACT_ARCHIVE_BELOW, Management, QueueStats

__all__ = ["DEFAULT_PORT", "ProcessCollector", "QueueCollector", "serve"]

logger = logging.getLogger(__name__)

#: ``kombu-pgmq metrics serve``'s port (also celery-exporter's default: run one of them on
#: another ``--port``).
DEFAULT_PORT = 9808
_STATES = ("ready", "in_flight", "delayed")

_HELP = {
    "deliveries": "Messages delivered to consumers by this process",
    "redeliveries": "Deliveries of messages delivered before (read_ct > 1)",
    "acks": "Messages acked (archived)",
    "rejects": "Messages rejected (requeued or dead-lettered)",
    "requeues": "Rejects with requeue",
    "dead_lettered": "Messages moved to the dead-letter queue by this process",
    "lease_renewals": "Visibility timeouts extended for messages being processed",
    "lost_leases": "Leases found lost (the message was delivered again elsewhere)",
    "publishes": "Messages published",
    "publish_errors": "Publishes that raised",
}


class QueueCollector(Collector):
    """Queue gauges of one database, from one statement per scrape.

    Arguments:
        url: the broker URL (``postgresql://...``).
        dead_letter_queue: Kombu name of the dead-letter queue (transport option
            ``dead_letter_queue``).
        exact_archive_below: archives with more rows report PostgreSQL's estimate.

    A scrape that cannot reach the database reports ``kombu_pgmq_up 0`` and no queue
    metrics (and logs the error); the next scrape reconnects.
    """

    def __init__(
        self,
        url: str,
        *,
        dead_letter_queue: str = DEFAULT_DEAD_LETTER_QUEUE,
        exact_archive_below: int = EXACT_ARCHIVE_BELOW,
    ) -> None:
        self._management = Management(url, dead_letter_queue=dead_letter_queue)
        self._exact_archive_below = exact_archive_below
        self._lock = threading.Lock()  # one connection: scrapes take turns

    def close(self) -> None:
        self._management.close()

    def describe(self) -> list[Metric]:
        """The metric families (so registering does not query the database)."""
        return list(self._families([], up=1, seconds=0.0))

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        with self._lock:
            try:
                stats = self._management.queues(exact_archive_below=self._exact_archive_below)
            except errors.KombuPgmqError as exc:
                logger.error("kombu_pgmq metrics: could not read queue statistics: %s", exc)
                stats, up = [], 0
            else:
                up = 1
        yield from self._families(stats, up=up, seconds=time.perf_counter() - started)

    @staticmethod
    def _families(stats: list[QueueStats], *, up: int, seconds: float) -> Iterator[Metric]:
        messages = GaugeMetricFamily(
            "kombu_pgmq_queue_messages",
            "Messages in a queue by state (ready, in_flight, delayed), priority bands summed",
            labels=["queue", "state"],
        )
        bands = GaugeMetricFamily(
            "kombu_pgmq_queue_band_messages",
            "Messages of a priority band (band: its lowest priority) by state",
            labels=["queue", "band", "state"],
        )
        age = GaugeMetricFamily(
            "kombu_pgmq_queue_oldest_message_age_seconds",
            "Seconds since the oldest ready or in-flight message was published (0: none)",
            labels=["queue"],
        )
        dead = GaugeMetricFamily(
            "kombu_pgmq_dead_letters",
            "Messages of the dead-letter queue that came from a queue",
            labels=["queue"],
        )
        archive = GaugeMetricFamily(
            "kombu_pgmq_archive_messages",
            "Archived messages of a queue (PostgreSQL's estimate above 100,000)",
            labels=["queue"],
        )
        consumers = GaugeMetricFamily(
            "kombu_pgmq_consumers", "Live consumers of a queue", labels=["queue"]
        )
        paused = GaugeMetricFamily(
            "kombu_pgmq_queue_paused", "1 if the queue is paused", labels=["queue"]
        )
        for q in stats:
            for state in _STATES:
                messages.add_metric([q.name, state], getattr(q, state))
            if len(q.bands) > 1:
                for b in q.bands:
                    for state in _STATES:
                        bands.add_metric([q.name, str(b.band), state], getattr(b, state))
            age.add_metric([q.name], q.oldest_age_seconds or 0.0)
            dead.add_metric([q.name], q.dead_letters)
            if q.archived is not None:
                archive.add_metric([q.name], q.archived)
            consumers.add_metric([q.name], q.consumers)
            paused.add_metric([q.name], 1 if q.paused else 0)
        yield from (messages, bands, age, dead, archive, consumers, paused)
        yield GaugeMetricFamily(
            "kombu_pgmq_up", "1 if the last scrape read the queue statistics", value=up
        )
        yield GaugeMetricFamily(
            "kombu_pgmq_scrape_duration_seconds",
            "Seconds the queue statistics took to read",
            value=seconds,
        )


class ProcessCollector(Collector):
    """This process's transport counters (see the module docstring)."""

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        for name in FIELDS:
            yield CounterMetricFamily(f"kombu_pgmq_{name}", _HELP[name], value=getattr(STATS, name))


def serve(
    url: str,
    *,
    port: int = DEFAULT_PORT,
    addr: str = "0.0.0.0",
    dead_letter_queue: str = DEFAULT_DEAD_LETTER_QUEUE,
    process: bool = False,
) -> tuple[Any, threading.Thread, CollectorRegistry]:
    """Serve ``/metrics`` on ``addr:port`` from a thread; returns ``(server, thread,
    registry)`` (stop with ``server.shutdown()``). ``process``: add this process's
    counters too (useful when the exporter runs inside a worker).

    Raises:
        OSError: the port is taken.
    """
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(QueueCollector(url, dead_letter_queue=dead_letter_queue))
    if process:
        registry.register(ProcessCollector())
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return server, thread, registry
