"""Helpers of the beat tests: Celery apps on a scratch database, schedulers ticked by hand
(in the test's thread or in a thread of their own), and what the database holds."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

from kombu_pgmq.beat import Scheduler
from tests.integration.helpers import sql, table

#: Small takeover: election rounds every 0.5 s, a leader stale after 1.5 s.
TAKEOVER = 2.5
TASK = "kpt.beat.ping"


def make_app(url: str, *, tasks: bool = True, **conf: Any) -> Celery:
    """A Celery app whose broker (and so the schedule) is ``url``; ``tasks``: it registers
    :data:`TASK` (then unknown task names are refused)."""
    app = Celery(f"kpt_beat_{uuid.uuid4().hex[:6]}", set_as_current=False)
    settings = {
        "broker_url": url,
        "result_expires": None,
        "beat_takeover_seconds": TAKEOVER,
        "broker_connection_retry_on_startup": True,
    }
    app.conf.update({**settings, **conf})
    if tasks:
        app.task(name=TASK, shared=False)(_ping)
    return app


def _ping(*args: Any, **kwargs: Any) -> None:
    pass


def step(s: Scheduler) -> None:
    """One pass of ``celery beat``'s loop: tick, then sleep what it asks."""
    delay = s.tick()
    if delay and delay > 0:
        time.sleep(min(delay, 0.5))


def tick_until(
    schedulers: list[Scheduler], predicate: Callable[[], Any], timeout: float, what: str
) -> Any:
    """Tick every scheduler in turn until ``predicate()`` holds (returned)."""
    deadline = time.monotonic() + timeout
    while True:
        for s in schedulers:
            step(s)
            value = predicate()
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


def lead(s: Scheduler, timeout: float = 10.0) -> Scheduler:
    tick_until([s], lambda: s.leader.is_leader, timeout, "a leader")
    return s


@contextmanager
def running(s: Scheduler) -> Iterator[threading.Thread]:
    """``s`` ticking in a thread of its own until the block ends."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                step(s)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "the scheduler thread did not stop"
    assert not errors, errors


def messages(url: str, queue: str = "celery") -> list[str]:
    """Task ids of the messages in ``queue`` (sent, not consumed)."""
    rows = sql(url, f"SELECT headers->>'id' FROM {table(queue)} ORDER BY msg_id")
    return [row[0] for row in rows]


def ticks(url: str, entry: str | None = None) -> list[tuple[Any, ...]]:
    """``(entry, due_at, kind, missed, task_id, epoch)`` of every tick, by due time."""
    return sql(
        url,
        "SELECT entry, due_at, kind, missed, task_id, epoch FROM kombu_pgmq.beat_ticks "
        "WHERE %(e)s::text IS NULL OR entry = %(e)s ORDER BY due_at, entry",
        {"e": entry},
    )


def entry_row(url: str, name: str) -> dict[str, Any]:
    rows = sql(
        url,
        "SELECT to_jsonb(e) FROM kombu_pgmq.beat_entries e WHERE name = %s",
        (name,),
    )
    assert rows, f"no entry {name!r}"
    result: dict[str, Any] = rows[0][0]
    return result
