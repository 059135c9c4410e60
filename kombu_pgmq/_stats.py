"""Per-process counters of the transport (exported by :mod:`kombu_pgmq.metrics`).

Plain integers on one object, bumped on the hot path (an attribute increment, no lock,
no prometheus-client import): the metrics collector reads them at scrape time. A forked
child starts from zero (its own process, its own counters). Increments from the lease
thread and the consumer thread may race and lose a count under contention; the counters
never go backwards.
"""

from __future__ import annotations

import os

#: Counter names, in export order (``kombu_pgmq_<name>_total``).
FIELDS = (
    "deliveries",
    "redeliveries",
    "acks",
    "settled_in_transaction",
    "rejects",
    "requeues",
    "dead_lettered",
    "lease_renewals",
    "lost_leases",
    "publishes",
    "publish_errors",
    "handoffs",
)


class ProcessStats:
    """Counters of this process (messages; see :data:`FIELDS`)."""

    __slots__ = FIELDS

    deliveries: int
    redeliveries: int
    acks: int
    settled_in_transaction: int
    rejects: int
    requeues: int
    dead_lettered: int
    lease_renewals: int
    lost_leases: int
    publishes: int
    publish_errors: int
    handoffs: int

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        for name in FIELDS:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FIELDS}


STATS = ProcessStats()
os.register_at_fork(after_in_child=STATS.reset)
