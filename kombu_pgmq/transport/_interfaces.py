"""The interfaces between the transport's objects, as typing Protocols.

* :class:`TransportView`: what a channel, its reader and publisher, and the poller use of
  their :class:`~kombu_pgmq.transport.transport.Transport`;
* :class:`ChannelView` (and :class:`QoSView`): what a channel's reader and publisher use of
  their :class:`~kombu_pgmq.transport.channel.Channel`;
* :class:`ConsumingChannel` (and :class:`ReaderView`, :class:`PollerView`): what the poller
  uses of a channel, and the channel of the poller.

The modules implementing them name these, not each other's classes, so none imports the
one that imports it (no import circle, not even for type checking); mypy checks that the
classes fit where they are passed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from .._db.broker import Broker, Receipt, Row
from ._leases import LeaseKeeper
from .options import TransportOptions
from .topology import Topology

__all__ = [
    "ChannelView",
    "Consumed",
    "ConsumingChannel",
    "PollerView",
    "QoSView",
    "ReaderView",
    "TransportView",
]


class Consumed(NamedTuple):
    """What one read round of a channel did (``Reader.consume``)."""

    #: Messages handed to consumers.
    delivered: int
    #: PGMQ names of queues found empty.
    drained: set[str]
    #: PGMQ names of queues that filled the read (they may hold more).
    full: set[str]
    #: Whether the acks given were archived with the read (False: the caller archives them).
    acks_sent: bool
    #: The read was put off until half the prefetch window is free.
    deferred: bool
    #: PGMQ names of queues a rate limit held back -> seconds until it allows more
    #: (``kombu_pgmq.read_limited``): read them again then (no notification comes for it).
    retry: Mapping[str, float] = MappingProxyType({})


class ReaderView(Protocol):
    """A channel's read path, as the poller drives it."""

    def consume(self, only: set[str] | None, acks: list[Receipt]) -> Consumed: ...

    def is_no_ack(self, queue: str) -> bool: ...

    def deliver_rows(self, queue: str, name: str, rows: list[Row]) -> int: ...


class ConsumingChannel(Protocol):
    """A channel, as the poller reads it."""

    @property
    def consumed_queues(self) -> list[str]: ...

    @property
    def reader(self) -> ReaderView: ...

    @property
    def qos(self) -> Any: ...


class PollerView(Protocol):
    """The poller, as channels and their QoS use it (wake-ups, acks)."""

    @property
    def in_event_loop(self) -> bool: ...

    @property
    def defers_acks(self) -> bool: ...

    def defer_ack(self, held: Receipt) -> None: ...

    def flush_acks(self) -> None: ...

    def wake(self, requeued: str | None = None) -> None: ...

    def on_consume(self, names: Sequence[str]) -> None: ...

    def on_cancel(self, names: Sequence[str]) -> None: ...


class TransportView(Protocol):
    """A transport, as its channels, their parts and its poller use it."""

    @property
    def options(self) -> TransportOptions: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def poller(self) -> PollerView: ...

    @property
    def leases(self) -> LeaseKeeper: ...

    @property
    def owner(self) -> str: ...

    @property
    def dsn(self) -> str: ...

    @property
    def listen_dsn(self) -> str | None: ...

    @property
    def client(self) -> Any: ...

    @property
    def polling_interval(self) -> float: ...

    @property
    def channels(self) -> Sequence[ConsumingChannel]: ...

    @property
    def unconfirmed_failed(self) -> list[tuple[str, str, str, int, int]]: ...

    @property
    def connection_errors(self) -> tuple[type[BaseException], ...]: ...

    @property
    def channel_errors(self) -> tuple[type[BaseException], ...]: ...

    def broker(self) -> Broker: ...

    def broker_if_connected(self) -> Broker | None: ...

    def broker_for_publish(self) -> Broker: ...

    def register_consumer(self, queue: str, consumer_tag: str) -> None: ...

    def release_consumer(self, queue: str, consumer_tag: str) -> bool: ...

    def keep_leases(self) -> None: ...


class QoSView(Protocol):
    """A channel's QoS, as its reader uses it."""

    @property
    def prefetch_count(self) -> int: ...

    def can_consume_max_estimate(self) -> int | None: ...

    def append(self, message: Any, delivery_tag: Any) -> None: ...

    def holds(self, delivery_tag: Any) -> bool: ...

    def forget(self, delivery_tag: Any) -> None: ...


class ChannelView(Protocol):
    """A channel, as its reader and publisher use it."""

    @property
    def connection(self) -> TransportView: ...

    @property
    def broker(self) -> Broker: ...

    @property
    def qos(self) -> QoSView: ...

    @property
    def consumed_queues(self) -> list[str]: ...

    @property
    def exchange_types(self) -> dict[str, Any]: ...

    @property
    def deadletter_queue(self) -> Any: ...

    def Message(self, payload: Any, channel: Any = None, **kwargs: Any) -> Any: ...

    def declare_queue(self, queue: str) -> None: ...

    def recreate(self, queue: str) -> None: ...

    def declared(self, queue: str) -> bool: ...

    def plain(self, queue: str) -> bool: ...

    def forget_queue(self, queue: str) -> None: ...
