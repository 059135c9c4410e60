"""How ``kombu-pgmq queues`` and ``kombu-pgmq queue limit`` print a queue's limits
(:mod:`kombu_pgmq.cli._limit_text`; no database)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from kombu_pgmq._db.limits import LimitInfo
from kombu_pgmq.cli._limit_text import describe, limits_json, summary


def info(**fields: Any) -> LimitInfo:
    defaults: dict[str, Any] = dict(
        queue="q",
        concurrency=None,
        rate=None,
        rate_per_second=None,
        burst=None,
        limit_key="x-limit-key",
        key_concurrency=None,
        key_rate=None,
        key_rate_per_second=None,
        key_burst=None,
        ordered_keys=False,
        in_flight=0,
        tokens=None,
        keys_in_flight=0,
        keys_at_limit=0,
        throttled_concurrency=0,
        throttled_rate=0,
        throttled_keys=0,
        updated_at=datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc),
        updated_by="ops",
    )
    return LimitInfo(**{**defaults, **fields})


def test_summary_cells() -> None:
    assert summary(None) == ""
    assert summary(info(concurrency=5, in_flight=3)) == "conc 3/5"
    both = info(concurrency=5, in_flight=3, rate="100/s", rate_per_second=100.0, burst=10.0)
    assert summary(both) == "conc 3/5 · 100/s"
    assert summary(info(key_concurrency=2)) == "key 2"
    assert summary(info(key_rate="10/s", key_rate_per_second=10.0, key_burst=1.0)) == "key 10/s"
    keyed = info(concurrency=3, in_flight=0, key_concurrency=2, key_rate="1/s")
    assert summary(keyed) == "conc 0/3 · key 2, 1/s"
    fifo = info(limit_key="x-group-id", key_concurrency=1, ordered_keys=True, rate="5/s")
    assert summary(fifo) == "5/s · fifo"


def test_describe_lines() -> None:
    assert describe("q", None) == [
        "queue q has no limits (set one: kombu-pgmq queue limit q --concurrency 20 --rate 100/s)"
    ]
    lines = describe(
        "q",
        info(
            concurrency=5,
            in_flight=2,
            rate="6000/m",
            rate_per_second=100.0,
            burst=1.0,
            tokens=0.25,
            limit_key="task",
            key_concurrency=2,
            keys_in_flight=4,
            keys_at_limit=1,
            throttled_concurrency=1200,
        ),
    )
    assert lines == [
        "limits of queue q (set 2026-11-24 12:00:00 UTC by ops):",
        "  concurrency      5 across every worker (2 in flight now)",
        "  rate             6000/m (100 per second; burst 1 token, 0.2 left now)",
        "  per key          concurrency 2 per Celery task name (4 keys in flight, 1 at their "
        "limit)",
        "  reads held back  concurrency 1,200, rate 0, keys 0",
    ]
    fifo = describe("f", info(limit_key="x-group-id", key_concurrency=1, ordered_keys=True))
    assert fifo[1:4] == [
        "  concurrency      none (0 in flight now)",
        "  rate             none",
        "  per key          FIFO queue: header x-group-id, one message per group at a time, in "
        "publish order (0 keys in flight, 0 at their limit)",
    ]


def test_json_has_the_same_keys_limited_or_not() -> None:
    unlimited = limits_json("q", None)
    limited = limits_json("q", info(concurrency=2))
    assert unlimited.keys() == limited.keys()
    assert (unlimited["queue"], unlimited["limited"], unlimited["concurrency"]) == (
        "q",
        False,
        None,
    )
    assert (limited["limited"], limited["concurrency"]) == (True, 2)
    assert json.loads(json.dumps(limited))["updated_at"] == "2026-11-24T12:00:00+00:00"
