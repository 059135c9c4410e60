"""How ``kombu-pgmq queues`` and ``kombu-pgmq queue limit`` show a queue's limits
(:class:`~kombu_pgmq._db.limits.LimitInfo`): pure formatting, no database."""

from __future__ import annotations

from typing import Any

from ..management import LimitInfo
from ._base import _when

__all__ = ["describe", "limits_json", "summary"]

#: The header a FIFO queue (``x-fifo-groups``) is keyed by.
FIFO_KEY = "x-group-id"


def _num(value: float) -> str:
    """``10.0`` -> ``"10"``, ``2.5`` -> ``"2.5"``."""
    return f"{value:g}"


def _tokens(value: float) -> str:
    return f"{_num(value)} token{'' if value == 1 else 's'}"


def _key_part(info: LimitInfo) -> str | None:
    if info.ordered_keys:
        return "fifo"
    given = [
        *([str(info.key_concurrency)] if info.key_concurrency is not None else []),
        *([info.key_rate] if info.key_rate is not None else []),
    ]
    return f"key {', '.join(given)}" if given else None


def summary(info: LimitInfo | None) -> str:
    """One cell of ``kombu-pgmq queues``' limits column: ``conc 3/5`` (in flight /
    concurrency), the rate as given (``100/s``), ``key 2`` (key concurrency; ``key 2,
    10/s`` with a key rate), ``fifo`` (a FIFO queue: one message per group at a time),
    joined by `` · ``; ``""`` when not limited."""
    if info is None:
        return ""
    parts = [
        *([f"conc {info.in_flight}/{info.concurrency}"] if info.concurrency is not None else []),
        *([info.rate] if info.rate is not None else []),
    ]
    key = _key_part(info)
    if key is not None:
        parts.append(key)
    return " · ".join(parts)


def describe(queue: str, info: LimitInfo | None) -> list[str]:
    """The lines of ``kombu-pgmq queue limit QUEUE`` without options: each limit in
    force with its use now, the reads held back, who set them and when."""
    if info is None:
        return [
            f"queue {queue} has no limits (set one: kombu-pgmq queue limit {queue} "
            "--concurrency 20 --rate 100/s)"
        ]
    lines = [f"limits of queue {queue} (set {_when(info.updated_at)} UTC by {info.updated_by}):"]
    if info.concurrency is not None:
        lines.append(
            f"  concurrency      {info.concurrency} across every worker "
            f"({info.in_flight} in flight now)"
        )
    else:
        lines.append(f"  concurrency      none ({info.in_flight} in flight now)")
    if info.rate is not None and info.burst is not None:
        tokens = "" if info.tokens is None else f", {info.tokens:.1f} left now"
        lines.append(
            f"  rate             {info.rate} ({_num(info.rate_per_second or 0)} per second; "
            f"burst {_tokens(info.burst)}{tokens})"
        )
    else:
        lines.append("  rate             none")
    use = f"{info.keys_in_flight} keys in flight, {info.keys_at_limit} at their limit"
    if info.ordered_keys:
        lines.append(
            f"  per key          FIFO queue: header {info.limit_key}, one message per group at "
            f"a time, in publish order ({use})"
        )
    elif info.key_concurrency is not None or info.key_rate is not None:
        given = [
            *([f"concurrency {info.key_concurrency}"] if info.key_concurrency is not None else []),
            *(
                [f"rate {info.key_rate} (burst {_num(info.key_burst)})"]
                if info.key_rate is not None and info.key_burst is not None
                else []
            ),
        ]
        key = "Celery task name" if info.limit_key == "task" else f"header {info.limit_key}"
        lines.append(f"  per key          {', '.join(given)} per {key} ({use})")
    else:
        lines.append("  per key          none")
    lines.append(
        f"  reads held back  concurrency {info.throttled_concurrency:,}, rate "
        f"{info.throttled_rate:,}, keys {info.throttled_keys:,}"
    )
    return lines


def limits_json(queue: str, info: LimitInfo | None) -> dict[str, Any]:
    """``kombu-pgmq queue limit QUEUE --json``: ``{"queue": ..., "limited": bool}`` and
    every field of :class:`~kombu_pgmq._db.limits.LimitInfo` (None when not limited)."""
    fields = dict.fromkeys(LimitInfo._fields) if info is None else info.as_dict()
    return {**fields, "queue": queue, "limited": info is not None}
