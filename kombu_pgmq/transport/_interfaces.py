"""The interfaces between the transport's objects that call each other both ways, as
typing Protocols.

* :class:`TransportView`: what a channel and its publisher use of their
  :class:`~kombu_pgmq.transport.transport.Transport` (kombu gives a channel the
  transport that made it, and the transport's poller reads the channels);
* :class:`ChannelView` (and :class:`QoSView`): what a channel's reader and publisher use of
  their :class:`~kombu_pgmq.transport.channel.Channel`, which made them;
* :class:`PollerView`: what a channel and its QoS use of the transport's
  :class:`~kombu_pgmq.transport.poller.Poller` (consumers started and cancelled, acks),
  which reads through the channels' readers.

The modules name these, not each other's classes, so none imports the one that imports
it (no import circle, not even for type checking); mypy checks that the classes fit where
they are passed. Every other collaborator is passed in, by its class, where an object is
made (the poller gets the channels' readers, a reader and a QoS what they use).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .._db.broker import Broker, Receipt
from ._leases import LeaseKeeper
from .options import TransportOptions
from .topology import Topology

__all__ = [
    "ChannelView",
    "PollerView",
    "QoSView",
    "TransportView",
]


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
    """A transport, as its channels and their publishers use it."""

    @property
    def options(self) -> TransportOptions: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def poller(self) -> PollerView: ...

    @property
    def leases(self) -> LeaseKeeper: ...

    @property
    def client(self) -> Any: ...

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

    def can_consume(self) -> bool: ...

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
