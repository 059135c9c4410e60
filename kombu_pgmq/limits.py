"""Fleet-wide concurrency and rate limits per queue and per key.

Limits are enforced where messages are delivered: in the read statement of every worker,
so ten workers with a queue limited to ``100/s`` deliver 100 messages a second between
them (Celery's ``rate_limit`` is per worker: celery/celery#5732), and a concurrency limit
holds across the fleet (Celery has none). What a limit counts:

* ``concurrency``: tasks of the queue delivered and not yet finished: messages delivered
  and not settled whose lease is live (visibility timeout in the future), and tasks a
  Celery worker still runs after acking their message (Celery's default early ack: the
  worker holds the task's slot until it finishes, :mod:`kombu_pgmq.transport._slots`).
  Prefetched messages count: a worker is never handed a message it may not start. A
  killed worker's messages and slots stop counting when their visibility timeout passes.
* ``rate``: a token bucket, ``"100/s"``, ``"6000/m"``, ``"50/h"`` (Celery's ``rate_limit``
  format; a bare number is per second), holding at most ``burst`` tokens (default: the
  tokens of 0.1 s, at least 1). Each delivery takes one.
* ``key_concurrency``, ``key_rate``, ``key_burst``: the same per key. A message's key is
  its header named by ``limit_key`` (default ``x-limit-key``, set per call with
  ``apply_async(headers={"x-limit-key": "customer-42"})``; ``limit_key="task"`` keys
  Celery tasks by task name). Messages without it have no key limit.
* FIFO queues (``x-fifo-groups``) are the concurrency-1 case: key ``x-group-id``, one
  task per group at a time, in publish order.

Set them with the transport option ``queue_limits`` (applied each time a worker declares
the queue), ``kombu-pgmq queue limit NAME``, or SQL:
``SELECT kombu_pgmq.set_queue_limits('queue', '{"concurrency": 20, "rate": "100/s"}')``.
See ``docs/limits.md``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from .errors import ConfigurationError

__all__ = ["LIMIT_NAMES", "parse_rate", "validate_limits"]

#: The limits a queue takes (keys of ``queue_limits`` entries and of
#: ``kombu_pgmq.set_queue_limits``' JSON).
LIMIT_NAMES = (
    "concurrency",
    "rate",
    "burst",
    "key_concurrency",
    "key_rate",
    "key_burst",
    "limit_key",
)

_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(?:/\s*([smh]))?\s*$")
_PER = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(rate: str | float | int, *, what: str = "rate") -> float:
    """Messages per second of a rate written as Celery's ``rate_limit``: ``"100/s"``,
    ``"6000/m"``, ``"50/h"``, or a number (per second). Mirrors
    the SQL function ``kombu_pgmq.rate_per_second``.

    Raises:
        ConfigurationError: not a rate, or not above 0 (the message names ``what``).
    """
    text = str(rate)
    match = _RATE.match(text) if not isinstance(rate, bool) else None
    if match is None:
        raise ConfigurationError(
            f"{what} {rate!r} is not a rate: write it as '100/s', '6000/m' or '50/h'"
        )
    per_second = float(match.group(1)) / _PER[match.group(2) or "s"]
    if per_second <= 0:
        raise ConfigurationError(f"{what} {rate!r} must be above 0 (clear the limit instead)")
    return per_second


def _positive_int(value: Any, what: str) -> int | None:
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"{what}={value!r} is invalid: expected an int >= 1 (0 or None: no limit)"
        )
    return value


def _burst(value: Any, what: str) -> float | None:
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise ConfigurationError(f"{what}={value!r} is invalid: expected tokens >= 1")
    return float(value)


def validate_limits(
    queue: str, limits: Mapping[str, Any], *, complete: bool = True
) -> dict[str, Any]:
    """The limits of ``queue`` checked and normalized for ``kombu_pgmq.set_queue_limits``:
    ``{name: value}`` with ints, rate strings, floats, or None (no such limit).
    ``complete``: ``limits`` is the whole set (a burst needs its rate in it); else a
    change of some limits, the others kept.

    Raises:
        ConfigurationError: not a mapping, an unknown name (the closest known one is
            suggested), a bad value, or a burst without its rate; the message names the
            queue and the limit.
    """
    if not isinstance(limits, Mapping):
        raise ConfigurationError(
            f"the limits of queue {queue!r} must be a dict such as "
            f"{{'concurrency': 20, 'rate': '100/s'}}, not {limits!r}"
        )
    unknown = sorted(str(k) for k in limits if k not in LIMIT_NAMES)
    if unknown:
        close = [difflib.get_close_matches(name, LIMIT_NAMES, n=1) for name in unknown]
        hints = [
            f"{name!r} (did you mean {match[0]!r}?)" if match else repr(name)
            for name, match in zip(unknown, close, strict=True)
        ]
        raise ConfigurationError(
            f"unknown limit(s) {', '.join(hints)} for queue {queue!r}: use {', '.join(LIMIT_NAMES)}"
        )
    out: dict[str, Any] = {}
    for name in ("concurrency", "key_concurrency"):
        if name in limits:
            out[name] = _positive_int(limits[name], f"queue {queue!r}: {name}")
    for name in ("rate", "key_rate"):
        if name in limits:
            value = limits[name]
            if value is None or (value == 0 and not isinstance(value, bool)) or value == "0":
                out[name] = None
            else:
                parse_rate(value, what=f"queue {queue!r}: {name}")
                out[name] = str(value).strip()
    for name in ("burst", "key_burst"):
        if name in limits:
            out[name] = _burst(limits[name], f"queue {queue!r}: {name}")
    for burst, rate in (("burst", "rate"), ("key_burst", "key_rate")):
        rate_gone = (rate in out and out[rate] is None) or (complete and rate not in out)
        if out.get(burst) is not None and rate_gone:
            raise ConfigurationError(
                f"queue {queue!r}: {burst} needs {rate} (a burst is the size of a rate's "
                "token bucket)"
            )
    if "limit_key" in limits:
        key = limits["limit_key"]
        if key is not None and (not isinstance(key, str) or not key.strip()):
            raise ConfigurationError(
                f"queue {queue!r}: limit_key={key!r} is invalid: expected a header name "
                "('x-limit-key', the default) or 'task' (Celery's task name)"
            )
        out["limit_key"] = key.strip() if key else None
    return out
