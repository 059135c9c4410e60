"""The base of a channel's parts (:class:`~kombu_pgmq.transport.reader.Reader`,
:class:`~kombu_pgmq.transport.publisher.Publisher`): the channel they belong to, its
options, its transport and its broker."""

from __future__ import annotations

from .._db.broker import Broker
from ._interfaces import ChannelView, TransportView
from .options import TransportOptions

__all__ = ["ChannelPart"]


class ChannelPart:
    """One part of a channel (see the module docstring)."""

    def __init__(self, channel: ChannelView) -> None:
        self.channel = channel
        #: The connection's validated transport options.
        self.options: TransportOptions = channel.connection.options

    @property
    def connection(self) -> TransportView:
        """The channel's transport."""
        return self.channel.connection

    @property
    def broker(self) -> Broker:
        """Broker operations on the transport's statement connection."""
        return self.channel.broker
