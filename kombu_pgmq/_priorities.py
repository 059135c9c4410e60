"""Message priorities: one PGMQ queue per priority band.

A queue declared with ``x-max-priority`` (AMQP's queue argument; Kombu
``Queue(max_priority=N)``) gets one PGMQ queue per *band*. A band holds the priorities
from its *floor* up to the next band's floor; by default every priority level from 0 to
``min(x-max-priority, 9)`` is its own band (transport option ``priority_steps``
coarsens that, as kombu's Redis transport does). Band 0 is the queue's own PGMQ queue, so
messages without a priority, and queues without ``x-max-priority``, are unchanged.

Ordering follows AMQP/RabbitMQ (higher number first, unlike kombu's Redis transport): a
consumer reads the bands highest first, in one round trip (``kombu_pgmq.read`` stops as
soon as the prefetch is filled), and each band in FIFO order (msg_id). Priority is
strict: lower bands are read only when the higher ones are empty, as in RabbitMQ.

Cost: a queue with 10 bands holds 10 PGMQ tables (and 10 archives), and a publish with
a priority costs what any publish costs. An empty band is read like any drained queue:
once, then the consumer waits on its NOTIFY channel and reads it again only when a
publish to it wakes the consumer (or at the fallback poll); so a busy consumer reads
only the bands that hold messages (measured: 98 of 100 reads of a backlog in band 0
touched band 0 only). Reading all 10 empty bands costs ~3.5 ms instead of ~1 ms (PGMQ's
read builds its SQL on every call), once per fallback poll of an idle consumer.
``benchmarks/priority_cost.py`` measures it. Message priorities above 9 count as 9.

The band layout (floors and PGMQ names) is stored in ``kombu_pgmq.queues`` by the first
declaration, and every producer and consumer uses the stored layout, so all agree.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from typing import Any, NamedTuple

from ._naming import pgmq_queue_name
from .errors import ConfigurationError

#: Highest priority level with a band of its own (Celery's range is 0-9).
MAX_LEVEL = 9
#: Largest ``x-max-priority`` accepted (AMQP allows 255; RabbitMQ advises <= 10).
MAX_PRIORITY_ARGUMENT = 255


class Bands(NamedTuple):
    """The priority bands of one queue: ``floors`` ascending (``floors[0] == 0``) and the
    PGMQ queue of each (``queues[0]`` is the queue's own PGMQ queue)."""

    floors: tuple[int, ...]
    queues: tuple[str, ...]

    def queue_for(self, priority: int) -> str:
        """PGMQ queue of the band holding ``priority`` (clamped to 0..9)."""
        if len(self.floors) == 1:
            return self.queues[0]
        return self.queues[bisect_right(self.floors, max(priority, 0)) - 1]

    @property
    def read_order(self) -> tuple[str, ...]:
        """PGMQ queues highest band first."""
        return self.queues[::-1]


def single(pgmq_queue: str) -> Bands:
    """The bands of a queue without priorities: just its own PGMQ queue."""
    return Bands((0,), (pgmq_queue,))


def band_queue_name(queue: str, floor: int) -> str:
    """PGMQ name of the band of Kombu queue ``queue`` starting at priority ``floor``.

    Band 0 is :func:`~kombu_pgmq._naming.pgmq_queue_name` of ``queue``; others are the
    encoded name of ``queue`` + NUL + ``priority_<floor>`` (e.g. ``tasks_priority_9__<12
    hex>``): no Kombu queue can be named so (PostgreSQL text cannot hold NUL), so band
    names never collide with queue names.
    """
    if floor == 0:
        return pgmq_queue_name(queue)
    return pgmq_queue_name(f"{queue}\x00priority_{floor}")


def max_priority_argument(arguments: dict[str, Any] | None, queue: str) -> int | None:
    """``x-max-priority`` of a queue declaration (None if absent).

    Raises:
        ConfigurationError: not an integer from 1 to 255.
    """
    value = (arguments or {}).get("x-max-priority")
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_PRIORITY_ARGUMENT
    ):
        raise ConfigurationError(
            f"queue {queue!r} argument x-max-priority={value!r} is invalid: expected an int "
            "from 1 to 255 (priorities above 9 share the band of 9)"
        )
    return value


def validate_steps(steps: Any) -> tuple[int, ...] | None:
    """Check the ``priority_steps`` transport option (None: a band per level).

    Raises:
        ConfigurationError: not a list of ints from 0 to 9.
    """
    if steps is None:
        return None
    try:
        values = tuple(steps)
    except TypeError:
        values = ("?",)
    if not values or any(
        isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LEVEL for v in values
    ):
        raise ConfigurationError(
            f"transport option priority_steps={steps!r} is invalid: expected a list of "
            "ints from 0 to 9, e.g. [0, 3, 6, 9] (omit it for one band per priority)"
        )
    return tuple(sorted(set(values)))


def make_bands(queue: str, max_priority: int | None, steps: Iterable[int] | None) -> Bands:
    """Band layout for a new declaration of ``queue``."""
    if max_priority is None:
        return single(pgmq_queue_name(queue))
    top = min(max_priority, MAX_LEVEL)
    levels = range(top + 1) if steps is None else steps
    floors = tuple(sorted({0, *(s for s in levels if 0 < s <= top)}))
    return Bands(floors, tuple(band_queue_name(queue, f) for f in floors))


def stored(pgmq_queue: str, floors: Any, queues: Any) -> Bands:
    """Bands as stored in ``kombu_pgmq.queues`` (NULL arrays: no priorities)."""
    if not floors or not queues:
        return single(pgmq_queue)
    return Bands(tuple(int(f) for f in floors), tuple(str(q) for q in queues))
