"""Prometheus metrics (prometheus-client): queue depths from the database, and this
process's transport counters.

**Serve them** (one statement per snapshot, whatever the number of queues)::

    kombu-pgmq metrics serve --url postgresql://user@db/app --port 9808

:func:`serve` (and the command) listens on ``127.0.0.1`` unless given another ``host``
(``--host 0.0.0.0``: every interface; then serve HTTPS with ``certfile``/``keyfile``
(``--tls-cert``/``--tls-key``, mutual TLS with ``client_cafile``/``--tls-client-ca``) and
require HTTP basic auth with ``basic_auth`` (``--basic-auth-user``; a warning is logged
for each missing). Scrapes within ``cache_seconds`` (default 5 seconds) of the last read
of the statistics get that snapshot again, and concurrent scrapes share one read: any
number of scrapers costs at most one statement per ``cache_seconds``.

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
``kombu_pgmq_queue_dead_tuples{queue}``          dead row versions in its tables, not
                                                 vacuumed yet (server statistics)
``kombu_pgmq_queue_settled_in_transaction_total{queue}``  messages archived by their
                                                 task's own transaction
                                                 (:class:`~kombu_pgmq.AtomicTask`; counter;
                                                 absent without
                                                 ``kombu_pgmq.settled_in_transaction()``)
``kombu_pgmq_xmin_horizon_age_seconds``          seconds since the oldest holder of the
                                                 database's xmin horizon began its
                                                 transaction (0: none; absent when the
                                                 server hides it: ``pg_read_all_stats``)
``kombu_pgmq_xmin_horizon_age_xids``             transactions since that holder's xmin
``kombu_pgmq_xmin_horizon_holder{kind,pid,application_name,state,name}``  1 for that
                                                 holder (``kind``: ``session``,
                                                 ``replication_slot``,
                                                 ``prepared_transaction``)
``kombu_pgmq_queue_limit{queue,limit}``          a limited queue's limits across every
                                                 worker (:mod:`kombu_pgmq.limits`);
                                                 ``limit``: ``concurrency``,
                                                 ``rate_per_second``, ``burst`` (tokens),
                                                 ``key_concurrency``,
                                                 ``key_rate_per_second``, ``key_burst``
``kombu_pgmq_queue_limit_in_flight{queue}``      what its concurrency limit counts now
``kombu_pgmq_queue_limit_tokens{queue}``         tokens left in its rate's bucket
``kombu_pgmq_queue_limit_keys_at_limit{queue}``  keys at their ``key_concurrency``
``kombu_pgmq_queue_throttled_total{queue,limit}``  reads a limit held back (counter;
                                                 ``limit``: ``concurrency``, ``rate``,
                                                 ``keys``)
``kombu_pgmq_results{state}``                    Celery results stored by kombu_pgmq's
                                                 result backend, by state (``SUCCESS``...)
``kombu_pgmq_result_bytes{state}``               their encoded size in bytes
``kombu_pgmq_results_expired{state}``            results past ``result_expires`` not
                                                 deleted yet (the workers' sweep is late)
``kombu_pgmq_beat_leader{identity}``             1 while the beat of record (``host:pid``)
                                                 leads; 0 when it is gone and no other
                                                 took over yet (none: no beat ever led)
``kombu_pgmq_beat_leader_heartbeat_age_seconds`` seconds since the leader's last election
                                                 round (a hung leader's grows)
``kombu_pgmq_beat_last_run_timestamp_seconds``   per ``entry``: Unix time of the due time
                                                 last sent (none: never ran)
``kombu_pgmq_beat_next_run_timestamp_seconds``   per ``entry``: Unix time of its next due
                                                 time as the leader computed it
``kombu_pgmq_beat_runs_total{entry}``            ticks sent (counter; kept when replaced)
``kombu_pgmq_beat_missed_ticks_total{entry}``    due times folded into a catch-up tick or
                                                 skipped while no beat led (counter)
``kombu_pgmq_beat_entry_error{entry}``           1 while the entry has a ``last_error`` (an
                                                 unknown task, a queue that exists nowhere)
``kombu_pgmq_beat_entry_enabled{entry}``         1 if enabled (a disabled entry's next run
                                                 is not sent)
``kombu_pgmq_up``                                1 if the last read reached the database
``kombu_pgmq_scrape_duration_seconds``           seconds the last read (statement) took
``kombu_pgmq_scrape_age_seconds``                seconds since the served snapshot was
                                                 read (up to ``cache_seconds``)
==============================================  =========================================

Process metrics (:class:`ProcessCollector`; counters of the transport in this process,
from :mod:`kombu_pgmq._stats`): ``kombu_pgmq_deliveries_total``,
``kombu_pgmq_redeliveries_total`` (``read_ct`` > 1), ``kombu_pgmq_acks_total``,
``kombu_pgmq_rejects_total``, ``kombu_pgmq_requeues_total`` (rejects with requeue),
``kombu_pgmq_dead_lettered_total``, ``kombu_pgmq_lease_renewals_total``,
``kombu_pgmq_lost_leases_total``, ``kombu_pgmq_publishes_total``,
``kombu_pgmq_publish_errors_total``, ``kombu_pgmq_handoffs_total`` (deliveries handed off
at publish, without a read), ``kombu_pgmq_settled_in_transaction_total`` (messages an
:class:`~kombu_pgmq.AtomicTask` archived in its transaction, whose ack sent nothing). In
a Celery worker (prefork), deliveries, acks and leases happen in the main process: export
from there, e.g. on ``worker_init``::

    from celery.signals import worker_init

    @worker_init.connect
    def metrics(**_):
        from prometheus_client import REGISTRY, start_http_server
        REGISTRY.register(ProcessCollector())
        start_http_server(9809)

The database role needs the statistics function: the owner, or a role granted with
``kombu-pgmq schema grant producer ROLE`` (it sees counts, not messages). The result
metrics are left out, and nothing fails, when the database has no result backend tables
(schema older than version 18) or the role may not read their statistics; they cost one
scan of ``kombu_pgmq.results`` per snapshot (``results=False`` turns them off). The beat
metrics (:mod:`kombu_pgmq.beat`: two more statements per snapshot, the leader and the
entries; ``beat=False`` turns them off) are left out the same way without the beat tables
(``kombu_pgmq.beat_entries``) or the privilege (a ``producer`` or ``worker`` role has it).
Alert on, for example, ``max(kombu_pgmq_beat_leader) < 1`` (no beat leads) or ``time() -
kombu_pgmq_beat_next_run_timestamp_seconds > 60 and kombu_pgmq_beat_entry_enabled == 1``
(a tick is late). The limit metrics (one more statement per snapshot, counting the
in-flight messages of each limited queue) are left out the same way without the limits
(``kombu_pgmq.limits_info``) or the privilege (a ``worker`` role has it, a ``producer``
role not).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from . import errors
from ._db.beat import LeaderInfo, StoredEntry
from ._db.horizon import Horizon
from ._metrics_limits import limit_families
from ._stats import FIELDS, STATS
from .dlq import DEFAULT_DEAD_LETTER_QUEUE
from .management import EXACT_ARCHIVE_BELOW, Management, QueueStats, ResultStats

__all__ = [
    "DEFAULT_CACHE_SECONDS",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "ProcessCollector",
    "QueueCollector",
    "serve",
]

logger = logging.getLogger(__name__)

#: ``kombu-pgmq metrics serve``'s port (also celery-exporter's default: run one of them on
#: another ``--port``).
DEFAULT_PORT = 9808
#: ``serve``'s address: this machine only. ``"0.0.0.0"`` or ``"::"`` for every interface.
DEFAULT_HOST = "127.0.0.1"
#: Seconds a snapshot of the queue statistics is served again (:class:`QueueCollector`).
DEFAULT_CACHE_SECONDS = 5.0
_STATES = ("ready", "in_flight", "delayed")

_HELP = {
    "deliveries": "Messages delivered to consumers by this process",
    "redeliveries": "Deliveries of messages delivered before (read_ct > 1)",
    "acks": "Messages acked (archived)",
    "settled_in_transaction": (
        "Messages whose task archived them in its own transaction (AtomicTask): the "
        "worker's ack sent nothing"
    ),
    "rejects": "Messages rejected (requeued or dead-lettered)",
    "requeues": "Rejects with requeue",
    "dead_lettered": "Messages moved to the dead-letter queue by this process",
    "lease_renewals": "Visibility timeouts extended for messages being processed",
    "lost_leases": "Leases found lost (the message was delivered again elsewhere)",
    "publishes": "Messages published",
    "publish_errors": "Publishes that raised",
    "handoffs": "Deliveries handed off at publish to a waiting consumer (no read)",
}


class QueueCollector(Collector):
    """Queue gauges of one database, from one statement per snapshot.

    Arguments:
        url: the broker URL (``postgresql://...``).
        dead_letter_queue: Kombu name of the dead-letter queue (transport option
            ``dead_letter_queue``).
        exact_archive_below: archives with more rows report PostgreSQL's estimate.
        cache_seconds: scrapes within this many seconds of the last read of the
            statistics get that snapshot again (``kombu_pgmq_scrape_age_seconds`` says
            how old); 0 reads on every scrape. Either way one read runs at a time:
            scrapes that arrive while it runs wait and share its result, so any number
            of scrapers costs at most one statement per ``cache_seconds`` (plus the
            statement's own duration).
        results: also read the result backend's statistics (``kombu_pgmq_results``...).
        beat: also read the beat scheduler's leader and entries (``kombu_pgmq_beat_*``).

    A read that cannot reach the database gives ``kombu_pgmq_up 0`` and no queue
    metrics (and logs the error); it is cached like any snapshot, and the next read
    reconnects.

    Raises:
        ConfigurationError: ``cache_seconds`` is negative.
    """

    def __init__(
        self,
        url: str,
        *,
        dead_letter_queue: str = DEFAULT_DEAD_LETTER_QUEUE,
        exact_archive_below: int = EXACT_ARCHIVE_BELOW,
        cache_seconds: float = DEFAULT_CACHE_SECONDS,
        results: bool = True,
        beat: bool = True,
    ) -> None:
        if not cache_seconds >= 0:
            raise errors.ConfigurationError(
                f"cache_seconds={cache_seconds!r}: give 0 (no cache) or more seconds"
            )
        self._management = Management(url, dead_letter_queue=dead_letter_queue)
        self._exact_archive_below = exact_archive_below
        self._cache_seconds = cache_seconds
        self._lock = threading.Lock()  # one read at a time (and one connection)
        self._snapshot: _Snapshot | None = None
        self._results = results
        self._beat = beat

    def close(self) -> None:
        self._management.close()

    def describe(self) -> list[Metric]:
        """The metric families (so registering does not query the database)."""
        return list(self._families(_Snapshot([], up=1, seconds=0.0, taken=0.0), age_seconds=0.0))

    def collect(self) -> Iterator[Metric]:
        snapshot = self._current(asked=time.monotonic())
        yield from self._families(snapshot, age_seconds=time.monotonic() - snapshot.taken)

    def _current(self, *, asked: float) -> _Snapshot:
        """The snapshot to serve a scrape that arrived at ``asked`` (monotonic seconds):
        the last one if it was read less than ``cache_seconds`` ago or finished after
        ``asked`` (the scrape waited for it), else a new read."""
        with self._lock:
            last = self._snapshot
            if last is not None and (
                last.finished >= asked or time.monotonic() - last.taken < self._cache_seconds
            ):
                return last
            self._snapshot = self._read()
            return self._snapshot

    def _read(self) -> _Snapshot:
        taken = time.monotonic()
        try:
            stats = self._management.queues(exact_archive_below=self._exact_archive_below)
        except errors.KombuPgmqError as exc:
            logger.error("kombu_pgmq metrics: could not read queue statistics: %s", exc)
            stats, up = [], 0
        else:
            up = 1
        horizon = self._read_horizon() if up else None
        results = self._read_results() if up else []
        beat = self._read_beat() if up else _Beat()
        return _Snapshot(
            stats,
            up=up,
            seconds=time.monotonic() - taken,
            taken=taken,
            results=results,
            beat=beat,
            horizon=horizon,
        )

    def _read_horizon(self) -> Horizon | None:
        """The oldest holder of the xmin horizon (None: none, or it could not be read:
        logged)."""
        try:
            return self._management.horizon()
        except errors.KombuPgmqError as exc:
            logger.warning("kombu_pgmq metrics: could not read the xmin horizon: %s", exc)
        return None

    def _read_results(self) -> list[ResultStats]:
        """The result backend's statistics; none (logged once) when the database has no
        result tables or the role may not read them, or after any other error."""
        if not self._results:
            return []
        try:
            return self._management.results()
        except (errors.ConfigurationError, errors.PermissionDenied) as exc:
            logger.info("kombu_pgmq metrics: no result backend metrics: %s", exc)
            self._results = False
        except errors.KombuPgmqError as exc:
            logger.warning("kombu_pgmq metrics: could not read result statistics: %s", exc)
        return []

    def _read_beat(self) -> _Beat:
        """The beat leader and entries; none (logged once) when the database has no beat
        tables or the role may not read them, or after any other error."""
        if not self._beat:
            return _Beat()
        try:
            return _Beat(self._management.beat_leader(), self._management.beat_entries())
        except (errors.ConfigurationError, errors.PermissionDenied) as exc:
            logger.info("kombu_pgmq metrics: no beat metrics: %s", exc)
            self._beat = False
        except errors.KombuPgmqError as exc:
            logger.warning("kombu_pgmq metrics: could not read the beat schedule: %s", exc)
        return _Beat()

    @staticmethod
    def _families(snapshot: _Snapshot, *, age_seconds: float) -> Iterator[Metric]:
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
        dead_tuples = GaugeMetricFamily(
            "kombu_pgmq_queue_dead_tuples",
            "Dead row versions in a queue's tables, not vacuumed yet (server statistics)",
            labels=["queue"],
        )
        settled = CounterMetricFamily(
            "kombu_pgmq_queue_settled_in_transaction",
            "Messages of a queue archived by their task's own transaction (AtomicTask)",
            labels=["queue"],
        )
        for q in snapshot.stats:
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
            if q.dead_tuples is not None:
                dead_tuples.add_metric([q.name], q.dead_tuples)
            if q.settled_in_transaction is not None:
                settled.add_metric([q.name], q.settled_in_transaction)
        yield from (messages, bands, age, dead, archive, consumers, paused, dead_tuples, settled)
        yield from _horizon_families(snapshot.horizon)
        yield from limit_families(snapshot.stats)
        results = GaugeMetricFamily(
            "kombu_pgmq_results",
            "Celery results stored by kombu_pgmq's result backend, by state",
            labels=["state"],
        )
        result_bytes = GaugeMetricFamily(
            "kombu_pgmq_result_bytes", "Encoded size of the stored results", labels=["state"]
        )
        expired = GaugeMetricFamily(
            "kombu_pgmq_results_expired",
            "Stored results past their expiry, not deleted yet",
            labels=["state"],
        )
        for r in snapshot.results:
            results.add_metric([r.state], r.results)
            result_bytes.add_metric([r.state], r.bytes)
            expired.add_metric([r.state], r.expired)
        yield from (results, result_bytes, expired)
        yield from _beat_families(snapshot.beat)
        yield GaugeMetricFamily(
            "kombu_pgmq_up",
            "1 if the last read of the queue statistics reached the database",
            value=snapshot.up,
        )
        yield GaugeMetricFamily(
            "kombu_pgmq_scrape_duration_seconds",
            "Seconds the last read of the queue statistics took",
            value=snapshot.seconds,
        )
        yield GaugeMetricFamily(
            "kombu_pgmq_scrape_age_seconds",
            "Seconds since the queue statistics served were read (cached up to cache_seconds)",
            value=age_seconds,
        )


@dataclass(frozen=True)
class _Snapshot:
    """One read of the queue statistics: ``seconds`` its duration, ``taken`` its start
    (``time.monotonic()``)."""

    stats: list[QueueStats]
    up: int
    seconds: float
    taken: float
    results: list[ResultStats] = field(default_factory=list)
    beat: _Beat = field(default_factory=lambda: _Beat())
    horizon: Horizon | None = None

    @property
    def finished(self) -> float:
        return self.taken + self.seconds


@dataclass(frozen=True)
class _Beat:
    """One read of the beat scheduler: the leader of record (None: none ever led, or not
    read) and the entries."""

    leader: LeaderInfo | None = None
    entries: list[StoredEntry] = field(default_factory=list)


def _horizon_families(horizon: Horizon | None) -> Iterator[Metric]:
    """The xmin horizon's age (0: nothing else holds one) and its holder."""
    seconds = GaugeMetricFamily(
        "kombu_pgmq_xmin_horizon_age_seconds",
        "Seconds since the oldest holder of the database's xmin horizon started its "
        "transaction (0: none; absent: hidden from this role, see the xids gauge)",
    )
    xids = GaugeMetricFamily(
        "kombu_pgmq_xmin_horizon_age_xids",
        "Transactions since the xmin the oldest holder of the horizon keeps (0: none)",
    )
    holder = GaugeMetricFamily(
        "kombu_pgmq_xmin_horizon_holder",
        "1 for the oldest holder of the xmin horizon (kind: session, replication_slot, "
        "prepared_transaction)",
        labels=["kind", "pid", "application_name", "state", "name"],
    )
    if horizon is None:
        seconds.add_metric([], 0.0)
        xids.add_metric([], 0)
    else:
        if horizon.age_seconds is not None:
            seconds.add_metric([], horizon.age_seconds)
        xids.add_metric([], horizon.xmin_age_xids)
        labels = [
            horizon.kind,
            "" if horizon.pid is None else str(horizon.pid),
            horizon.application_name or "",
            horizon.state or "",
            horizon.name or "",
        ]
        holder.add_metric(labels, 1)
    yield from (seconds, xids, holder)


def _beat_families(beat: _Beat) -> Iterator[Metric]:
    """The ``kombu_pgmq_beat_*`` families of one read (see the module docstring)."""
    leader = GaugeMetricFamily(
        "kombu_pgmq_beat_leader",
        "1 while the beat of record leads, 0 when it is gone and none took over yet",
        labels=["identity"],
    )
    heartbeat = GaugeMetricFamily(
        "kombu_pgmq_beat_leader_heartbeat_age_seconds",
        "Seconds since the beat leader's last election round",
    )
    if beat.leader is not None:
        leader.add_metric([beat.leader.identity], 1 if beat.leader.alive else 0)
        heartbeat.add_metric([], max(0.0, beat.leader.heartbeat_age))
    last_run = GaugeMetricFamily(
        "kombu_pgmq_beat_last_run_timestamp_seconds",
        "Unix time of the due time a periodic task was last sent for",
        labels=["entry"],
    )
    next_run = GaugeMetricFamily(
        "kombu_pgmq_beat_next_run_timestamp_seconds",
        "Unix time of a periodic task's next due time",
        labels=["entry"],
    )
    runs = CounterMetricFamily(
        "kombu_pgmq_beat_runs", "Ticks of a periodic task sent", labels=["entry"]
    )
    missed = CounterMetricFamily(
        "kombu_pgmq_beat_missed_ticks",
        "Due times of a periodic task caught up in one tick or skipped (no beat led)",
        labels=["entry"],
    )
    error = GaugeMetricFamily(
        "kombu_pgmq_beat_entry_error",
        "1 while a periodic task has an error (see kombu-pgmq beat list)",
        labels=["entry"],
    )
    enabled = GaugeMetricFamily(
        "kombu_pgmq_beat_entry_enabled", "1 if a periodic task is enabled", labels=["entry"]
    )
    for e in beat.entries:
        if e.last_run_at is not None:
            last_run.add_metric([e.name], e.last_run_at.timestamp())
        if e.next_run_at is not None:
            next_run.add_metric([e.name], e.next_run_at.timestamp())
        runs.add_metric([e.name], e.total_run_count)
        missed.add_metric([e.name], e.missed_ticks)
        error.add_metric([e.name], 1 if e.last_error else 0)
        enabled.add_metric([e.name], 1 if e.enabled else 0)
    yield from (leader, heartbeat, last_run, next_run, runs, missed, error, enabled)


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
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    certfile: str | None = None,
    keyfile: str | None = None,
    client_cafile: str | None = None,
    basic_auth: tuple[str, str] | None = None,
    cache_seconds: float = DEFAULT_CACHE_SECONDS,
    dead_letter_queue: str = DEFAULT_DEAD_LETTER_QUEUE,
    process: bool = False,
    addr: str | None = None,
) -> tuple[WSGIServer, threading.Thread, CollectorRegistry]:
    """Serve ``/metrics`` (every path answers the same) from a daemon thread; returns
    ``(server, thread, registry)``: ``server.server_address`` is the bound
    ``(host, port)``; ``server.shutdown()`` stops serving, then ``server.server_close()``
    closes the socket and the database connection.

    Arguments:
        host: address to listen on; the default ``127.0.0.1`` is this machine only,
            ``"0.0.0.0"`` (``"::"``) every interface: then give TLS and ``basic_auth``
            (a warning is logged for each missing). ``addr``: its old name (wins if given).
        port: TCP port; 0 picks a free one.
        certfile, keyfile: PEM certificate (chain) and its unencrypted PEM key: serve
            HTTPS (TLS 1.2 or newer). Both or neither.
        client_cafile: PEM CA certificates (needs ``certfile``): scrapers must present a
            certificate signed by one of them (mutual TLS).
        basic_auth: ``(user, password)``: other requests get ``401`` (see
            :class:`kombu_pgmq._metrics_server.BasicAuth`).
        cache_seconds: see :class:`QueueCollector` (seconds; 0: read on every scrape).
        process: add this process's counters too (:class:`ProcessCollector`; useful when
            the exporter runs inside a worker).

    Raises:
        ConfigurationError: ``certfile`` without ``keyfile`` (or the reverse),
            ``client_cafile`` without them, a TLS file that cannot be loaded, an empty
            basic auth user or password, a negative ``cache_seconds``.
        OSError: ``host`` is not an address of this machine, or the port is taken
            (``errno.EADDRINUSE``).
    """
    from prometheus_client import make_wsgi_app

    from . import _metrics_server

    host = addr if addr is not None else host
    if (certfile is None) != (keyfile is None):
        raise errors.ConfigurationError(
            "certfile and keyfile go together: give both (HTTPS) or neither (HTTP)"
        )
    if client_cafile is not None and certfile is None:
        raise errors.ConfigurationError(
            "client_cafile (mutual TLS) needs certfile and keyfile (the server's own)"
        )
    tls = None
    if certfile is not None and keyfile is not None:
        tls = _metrics_server.tls_context(certfile, keyfile, client_cafile)
    registry = CollectorRegistry()
    app = make_wsgi_app(registry)
    if basic_auth is not None:
        app = _metrics_server.BasicAuth(app, *basic_auth)
    collector = QueueCollector(
        url, dead_letter_queue=dead_letter_queue, cache_seconds=cache_seconds
    )
    registry.register(collector)
    if process:
        registry.register(ProcessCollector())
    try:
        server, thread = _metrics_server.start(app, host, port, tls, on_close=collector.close)
    except OSError:
        collector.close()
        raise
    bound, bound_port = _metrics_server.bound(server)
    missing = [
        what
        for what, given in (("TLS", tls is not None), ("basic auth", basic_auth is not None))
        if not given
    ]
    if missing and not _metrics_server.is_loopback(bound):
        logger.warning(
            "kombu_pgmq metrics: serving %s port %s without %s: anyone who reaches the port "
            "reads every queue's name and depth; add TLS (--tls-cert/--tls-key, "
            "serve(certfile=, keyfile=)) and basic auth (--basic-auth-user, "
            "serve(basic_auth=)), or listen on 127.0.0.1",
            bound,
            bound_port,
            " and without ".join(missing),
        )
    return server, thread, registry
