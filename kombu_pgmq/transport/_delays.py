"""Delayed delivery: Celery ETA/countdown and ``x-delay`` use PGMQ's native delay.

A message published with a delay is sent with a future visibility (``pgmq.send(queue,
message, headers, delay)``): it waits in its queue table, invisible, instead of in a
worker's memory.

* **Celery ETA/countdown** (``apply_async(countdown=600)``, ``eta=``, ``retry(countdown=)``):
  Celery's message protocol 2 carries the ETA in the ``eta`` header (ISO 8601). The
  transport sends such a message to become visible ``eta_lead_seconds`` (default 2)
  before its ETA; a worker then receives it shortly before the ETA and Celery holds it
  until the ETA exactly, as it does for every ETA task. So a task with a countdown of a
  day is not held (and prefetched) by a worker for a day, survives worker restarts
  without redelivery loops, and does not count against prefetch until it is due. An
  ETA without a time zone (``enable_utc=False`` and a naive datetime) or in the past is
  delivered at once, and Celery holds it as usual (its lease is renewed meanwhile, see
  :mod:`kombu_pgmq.transport._leases`). Consumers waiting on the queue are woken when it
  becomes due, as by a new message.
* **x-delay** header (milliseconds, as RabbitMQ's delayed-message exchange): delivered
  no earlier than that, rounded up to whole seconds (PGMQ's delay unit).

Celery's message protocol 1 (ETA in the body) is not inspected: delivered at once.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

from ..errors import ConfigurationError

#: Longest delay PGMQ takes (its delay argument is an int4 of seconds).
MAX_DELAY_SECONDS = 2**31 - 1


def delay_seconds(message: dict[str, Any], lead_seconds: float) -> int:
    """Whole seconds to keep a Kombu message ``{"headers": {...}, ...}`` invisible (0: none)."""
    headers = message.get("headers")
    if not headers:
        return 0
    x_delay = headers.get("x-delay")
    if x_delay is not None:
        try:
            ms = float(x_delay)
        except (TypeError, ValueError):
            return 0  # not a number: delivered at once, as without x-delay
        if not math.isfinite(ms) or ms / 1000.0 > MAX_DELAY_SECONDS:
            raise ConfigurationError(
                f"message header x-delay={x_delay!r} is invalid: expected milliseconds from "
                f"0 to {MAX_DELAY_SECONDS * 1000} (PGMQ delays are whole seconds in an int4)"
            )
        return max(0, math.ceil(ms / 1000.0))
    eta = headers.get("eta")
    if not eta or not isinstance(eta, str):
        return 0
    try:
        when = datetime.fromisoformat(eta)
    except ValueError:
        return 0
    if when.tzinfo is None:
        return 0
    seconds = (when - datetime.now(timezone.utc)).total_seconds() - lead_seconds
    if seconds > MAX_DELAY_SECONDS:
        raise ConfigurationError(
            f"task ETA {eta} is more than {MAX_DELAY_SECONDS} seconds (68 years) away: "
            "PGMQ cannot delay a message that long; choose a nearer ETA"
        )
    return int(seconds) if seconds >= 1 else 0
