"""Mapping of Kombu queue names to PGMQ queue names.

PGMQ queue names become table names ``pgmq.q_<name>`` / ``pgmq.a_<name>``: at most
47 characters and lower-cased by PGMQ (``MyQueue`` and ``myqueue`` are one table).
Celery's names contain ``.``, ``@``, ``-`` and upper case, and its pidbox reply queue
(``<uuid>.reply.celery.pidbox``) is 56 characters long.

The mapping is a pure function of the name, so every process computes the same PGMQ
name, and it is injective:

* a *plain* name (only ``[a-z0-9_]``, no ``__``, at most :data:`MAX_PLAIN_LENGTH`
  characters) maps to itself, so ``celery`` stays ``celery``;
* any other name maps to a readable slug, ``__`` and the first 12 hex digits of the
  BLAKE2b hash of the UTF-8 name, e.g. ``celery@host.celery.pidbox`` becomes
  ``celery_host_celery_pidbox__<12 hex>``.

Plain names never contain ``__`` and encoded names always do, so the two sets do not
overlap; two encoded names collide only if 48-bit hashes collide.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

from .errors import InvalidQueueName

#: PGMQ's limit (``pgmq.validate_queue_name``).
MAX_PGMQ_NAME_LENGTH = 47
#: Hex digits of the hash suffix of an encoded name.
HASH_HEX_DIGITS = 12
#: Longest Kombu name kept as is.
MAX_PLAIN_LENGTH = MAX_PGMQ_NAME_LENGTH
_SEPARATOR = "__"
_SLUG_LENGTH = MAX_PGMQ_NAME_LENGTH - len(_SEPARATOR) - HASH_HEX_DIGITS

_PLAIN = re.compile(r"[a-z0-9_]+")
_NOT_SLUG = re.compile(r"[^a-z0-9]+")


@lru_cache(maxsize=4096)
def pgmq_queue_name(queue: str) -> str:
    """Return the PGMQ queue name for the Kombu queue name *queue*.

    Shapes: ``str -> str`` of 1 to 47 characters from ``[a-z0-9_]``.

    Raises:
        InvalidQueueName: *queue* is not a non-empty ``str``.
    """
    if not isinstance(queue, str) or not queue:
        raise InvalidQueueName(
            f"queue name must be a non-empty string, got {queue!r}: name the queue"
        )
    if len(queue) <= MAX_PLAIN_LENGTH and _SEPARATOR not in queue and _PLAIN.fullmatch(queue):
        return queue
    digest = hashlib.blake2b(queue.encode("utf-8"), digest_size=8).hexdigest()[:HASH_HEX_DIGITS]
    slug = _NOT_SLUG.sub("_", queue.lower()).strip("_")[:_SLUG_LENGTH].rstrip("_") or "q"
    return f"{slug}{_SEPARATOR}{digest}"
