"""The ``kombu_pgmq_queue_limit*`` and ``kombu_pgmq_queue_throttled_total`` families of
:class:`kombu_pgmq.metrics.QueueCollector` (see its module docstring), from the limits
that :meth:`kombu_pgmq.management.Management.queues` read with the statistics
(``QueueStats.limits``; None for a queue without limits, and for every queue when they
could not be read: no ``kombu_pgmq.limits_info`` in the database, or a role without the
privilege)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .management import QueueStats

__all__ = ["LIMITS", "THROTTLED", "limit_families"]

#: The ``limit`` label of ``kombu_pgmq_queue_limit``: the attribute of ``LimitInfo``
#: (rates in messages per second, bursts in tokens, the default filled in).
LIMITS = (
    "concurrency",
    "rate_per_second",
    "burst",
    "key_concurrency",
    "key_rate_per_second",
    "key_burst",
)
#: The ``limit`` label of ``kombu_pgmq_queue_throttled_total`` -> its ``LimitInfo`` counter.
THROTTLED = {
    "concurrency": "throttled_concurrency",
    "rate": "throttled_rate",
    "keys": "throttled_keys",
}


def limit_families(stats: Iterable[QueueStats]) -> Iterator[Metric]:
    """The limit families of one snapshot: samples for the limited queues only (a limit
    not set has no sample)."""
    limit = GaugeMetricFamily(
        "kombu_pgmq_queue_limit",
        "A queue's limit across every worker: concurrency (messages), rate_per_second, "
        "burst (tokens), and the same per key",
        labels=["queue", "limit"],
    )
    in_flight = GaugeMetricFamily(
        "kombu_pgmq_queue_limit_in_flight",
        "Messages of a limited queue in flight (what its concurrency limit counts)",
        labels=["queue"],
    )
    tokens = GaugeMetricFamily(
        "kombu_pgmq_queue_limit_tokens",
        "Tokens left in a rate-limited queue's bucket",
        labels=["queue"],
    )
    keys_at_limit = GaugeMetricFamily(
        "kombu_pgmq_queue_limit_keys_at_limit",
        "Keys of a queue with key_concurrency messages in flight",
        labels=["queue"],
    )
    throttled = CounterMetricFamily(
        "kombu_pgmq_queue_throttled",
        "Reads of a queue that left visible messages undelivered because of a limit "
        "(concurrency, rate, keys), since the queue was limited",
        labels=["queue", "limit"],
    )
    for q in stats:
        info = q.limits
        if info is None:
            continue
        for name in LIMITS:
            value = getattr(info, name)
            if value is not None:
                limit.add_metric([q.name, name], value)
        in_flight.add_metric([q.name], info.in_flight)
        if info.tokens is not None:
            tokens.add_metric([q.name], info.tokens)
        if info.key_concurrency is not None:
            keys_at_limit.add_metric([q.name], info.keys_at_limit)
        for label, attribute in THROTTLED.items():
            throttled.add_metric([q.name, label], getattr(info, attribute))
    yield from (limit, in_flight, tokens, keys_at_limit, throttled)
