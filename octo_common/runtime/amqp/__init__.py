"""Octo's lean AMQP 0-9-1 client for the hot path (publish with confirm and
mandatory, consume, ack, nack, reject) and the few methods around it.

- ``codec.py``: the hot frames packed and unpacked with ``struct``, byte for
  byte what pamqp produces; pamqp for anything unusual.
- ``connection.py``: :class:`Connection`, an ``asyncio.Protocol`` writing once
  per loop pass; handshake, heartbeats, blocked state, close; :func:`connect`.
- ``channel.py``: :class:`Channel` (confirms, returns, deliveries, folded
  acks, synchronous methods) and :class:`AmqpDelivery`.
- ``errors.py``: :class:`ConnectionClosed`, :class:`ChannelClosed`.
"""

from octo_common.runtime.amqp.channel import ACKED, CLOSED, NACKED, AmqpDelivery, Channel
from octo_common.runtime.amqp.codec import Properties
from octo_common.runtime.amqp.connection import Connection, connect, parse_url
from octo_common.runtime.amqp.errors import AmqpError, ChannelClosed, ConnectionClosed

__all__ = [
    "ACKED",
    "CLOSED",
    "NACKED",
    "AmqpDelivery",
    "AmqpError",
    "Channel",
    "ChannelClosed",
    "Connection",
    "ConnectionClosed",
    "Properties",
    "connect",
    "parse_url",
]
