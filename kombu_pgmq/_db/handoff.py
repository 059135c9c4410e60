"""Hand-off at publish: a publish to a queue an idle consumer waits on
writes the row as delivered to that consumer and sends it in the consumer's NOTIFY, so
the consumer delivers it without a read. This module holds both ends of the NOTIFY
payload's format and the consumer's slot identity; the SQL is statement ``send_queue``
and ``kombu_pgmq.hand_off``/``wait_for_handoff``/``rearm_handoff``.

Payload: ``queue``, ``msg_id``, ``enqueued_at`` (UTC, ``YYYY-MM-DDTHH:MM:SS.ffffff``),
``message`` and ``headers``, separated by :data:`SEPARATOR` (ASCII record separator,
which JSON text never holds unescaped). The server writes the first three; the tail
(message and headers) is the text the publisher sent (:func:`tail`).
"""

from __future__ import annotations

import secrets
from datetime import datetime, timezone

from .rows import Row

__all__ = ["CHANNEL_PREFIX", "MAX_TAIL_BYTES", "SEPARATOR", "new_slot", "parse", "tail"]

#: Separates the payload's fields (chr(30) in the SQL).
SEPARATOR = "\x1e"

#: Largest tail handed off, in bytes: a NOTIFY payload must stay under 8000 bytes, and
#: the server adds the queue name (at most 47), msg_id (at most 20), enqueued_at (26) and
#: separators. A larger message is not handed off: the consumer is woken and reads it.
MAX_TAIL_BYTES = 7800

#: NOTIFY channel of a consumer's hand-offs: this prefix and 16 hex digits. PGMQ queue
#: names hold no ``.``, so no queue's wake-up channel (``kombu_pgmq.<queue>``) is one.
CHANNEL_PREFIX = "kombu_pgmq.handoff."


def tail(message: str, headers: str | None, delay_seconds: int) -> str | None:
    """The payload's tail for a publish of ``message``/``headers`` (JSON text), or None
    when it is not handed off: delayed (``delay_seconds > 0``), or too large for a
    NOTIFY (:data:`MAX_TAIL_BYTES`)."""
    if delay_seconds > 0:
        return None
    head = headers or ""
    chars = len(message) + len(head)
    if chars > MAX_TAIL_BYTES:  # a character: at least one byte
        return None
    if chars > MAX_TAIL_BYTES // 4:  # a character: at most 4 bytes
        size = len(message.encode("utf-8", "surrogatepass")) + len(head.encode("utf-8"))
        if size > MAX_TAIL_BYTES:
            return None
    return f"{message}{SEPARATOR}{head}"


def parse(payload: str) -> Row | None:
    """The delivered row a hand-off payload carries (``read_ct`` 1, age 0), or None if
    it is not one (malformed: the sender is not kombu_pgmq)."""
    parts = payload.split(SEPARATOR, 4)
    if len(parts) != 5:
        return None
    queue, msg_id, enqueued, message, headers = parts
    try:
        enqueued_at = datetime.fromisoformat(enqueued).replace(tzinfo=timezone.utc)
        return Row(int(msg_id), 1, message, headers or None, 0.0, queue, enqueued_at)
    except ValueError:
        return None


def new_slot() -> tuple[str, int]:
    """A fresh ``(channel, lock_key)`` for one LISTEN connection's hand-offs: its NOTIFY
    channel and the session advisory lock (a signed 64-bit key) it holds while it
    listens, so publishers skip its slots once it is gone."""
    token = secrets.token_bytes(8)
    return CHANNEL_PREFIX + token.hex(), int.from_bytes(token, "big", signed=True)
