"""Small helpers shared by integration tests (real PostgreSQL, no mocks)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psycopg
from kombu import Connection, Consumer, Producer, Queue

import kombu_pgmq  # noqa: F401  (registers postgresql://)
from kombu_pgmq._naming import pgmq_queue_name
from tests.support.waiting import wait_for as wait_for  # re-exported


def connect(url: str, **options: Any) -> Connection:
    return Connection(url, transport_options=options)


def publish(conn: Connection, queue: str, bodies: list[Any], **kwargs: Any) -> None:
    q = Queue(queue, routing_key=queue)
    with conn.channel() as channel:
        producer = Producer(channel)
        for body in bodies:
            producer.publish(body, routing_key=queue, declare=[q], **kwargs)


def drain(
    conn: Connection,
    queue: str,
    *,
    expect: int,
    ack: bool = True,
    prefetch: int = 10,
    timeout: float = 10.0,
) -> list[Any]:
    """Consume until *expect* messages arrived (or timeout); return the Message objects."""
    got: list[Any] = []

    def on_message(message: Any) -> None:  # raw message: bodies are not decoded here
        got.append(message)
        if ack:
            message.ack()

    channel = conn.channel()
    deadline = time.monotonic() + timeout
    with Consumer(
        channel, [Queue(queue, routing_key=queue)], on_message=on_message, prefetch_count=prefetch
    ):
        while len(got) < expect and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
    return got


def sql(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as c:
        cur = c.execute(query, params)
        return cur.fetchall() if cur.description else []


def table(queue: str, prefix: str = "q") -> str:
    return f"pgmq.{prefix}_{pgmq_queue_name(queue)}"


class FakeHub:
    """The part of kombu's Hub the transport uses, run by hand (no real loop needed)."""

    def __init__(self) -> None:
        self.readers: dict[int, Any] = {}
        self.soon: list[Any] = []
        self.on_tick: set[Any] = set()  # called at every turn, as kombu's Hub does

    def add_reader(self, fd: int, callback: Any, *args: Any) -> None:
        self.readers[fd] = (callback, args)

    def remove_reader(self, fd: int) -> None:
        self.readers.pop(fd, None)

    def call_soon(self, callback: Any, *args: Any) -> None:
        self.soon.append((callback, args))

    def call_later(self, seconds: float, callback: Any, *args: Any) -> None:
        self.soon.append((callback, args))  # at the next run_once

    def call_repeatedly(self, seconds: float, callback: Any, *args: Any) -> Any:
        class Entry:
            def cancel(self) -> None:
                pass

        return Entry()

    def run_once(self, timeout: float = 0.2) -> None:
        """Run the callbacks due, then those of the readers ready within ``timeout``
        seconds."""
        import select

        for tick in list(self.on_tick):
            tick()
        soon, self.soon = self.soon, []
        for callback, args in soon:
            callback(*args)
        if self.readers:
            ready, _, _ = select.select(list(self.readers), [], [], timeout)
            for fd in ready:
                if fd in self.readers:
                    callback, args = self.readers[fd]
                    callback(*args)


class WaitingConsumer:
    """A consumer (acks, never acking) draining ``queue`` in a thread, on its own
    connection: it waits on the queue between messages, offering a hand-off slot."""

    def __init__(self, url: str, queue: Queue, **options: Any) -> None:
        self.got: list[Any] = []
        self._options = options
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, queue), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the consumer did not start"

    def _run(self, url: str, queue: Queue) -> None:
        with (
            connect(url, **self._options) as conn,
            Consumer(
                conn.channel(), [queue], callbacks=[lambda body, m: self.got.append(body)]
            ) as consumer,
        ):
            consumer.qos(prefetch_count=100)
            self._ready.set()
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)

    def wait_for(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.got) < n:
            assert time.monotonic() < deadline, f"the consumer got {len(self.got)} of {n}"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
