"""Octo's own AMQP 0-9-1 connection: an ``asyncio.Protocol`` that writes once per loop tick.

Owns :class:`Connection` (the socket, the handshake, heartbeats, a blocked
broker, the connection's close, and the write buffer every channel appends
to) and :func:`connect`. Everything a channel sends in one pass of the
event loop goes out in one ``transport.write`` at the end of that pass
(``loop.call_soon``), acks of finished deliveries folded into as few
``basic.ack`` frames as their order allows (:meth:`Channel.take_acks`).
Received bytes are cut into frames and handed to their channel in the same
callback: no task, lock or queue per frame.

The hot frames are :mod:`octo_common.runtime.amqp.codec`; every other method
(handshake, declarations, consume, close) is pamqp's.

It must never: write a frame of a closed channel, log or raise a URL or
credentials, or keep a connection up after a missed heartbeat window (two
intervals without a byte from the broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import socket
import ssl
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, cast

from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame

from octo_common.runtime.amqp.channel import Channel, unmarshal_method
from octo_common.runtime.amqp.codec import (
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    HEARTBEAT_FRAME,
    FrameError,
    FrameReader,
)
from octo_common.runtime.amqp.errors import AmqpError, ConnectionClosed

__all__ = ["Connection", "ConnectionSettings", "connect", "parse_url"]

_PRODUCT: Final = "octo"
_CAPABILITIES: Final = {
    "authentication_failure_close": True,
    "basic.nack": True,
    "connection.blocked": True,
    "consumer_cancel_notify": True,
    "publisher_confirms": True,
}
_DEFAULT_FRAME_MAX: Final = 131072


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """Where and how to connect: parsed from an ``amqp://`` or ``amqps://`` URL."""

    host: str
    port: int
    username: str
    password: str
    vhost: str
    tls: bool

    def __repr__(self) -> str:  # never the password
        return f"ConnectionSettings(host={self.host!r}, port={self.port}, vhost={self.vhost!r})"


def parse_url(url: str) -> ConnectionSettings:
    """The settings of an AMQP URL; raises ``ValueError`` (without the URL) for
    anything else, including query parameters this client does not take."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("amqp", "amqps"):
        raise ValueError("not an amqp:// or amqps:// URL")
    if parts.query or parts.fragment:
        raise ValueError("URL parameters are not supported by this client")
    tls = parts.scheme == "amqps"
    try:
        port = parts.port or (5671 if tls else 5672)
    except ValueError:
        raise ValueError("malformed port") from None
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    vhost = urllib.parse.unquote(path) if path else "/"
    return ConnectionSettings(
        host=parts.hostname or "localhost",
        port=port,
        username=urllib.parse.unquote(parts.username or "guest"),
        password=urllib.parse.unquote(parts.password or "guest"),
        vhost=vhost,
        tls=tls,
    )


class Connection(asyncio.Protocol):
    """One AMQP connection (see the module docstring); made by :func:`connect`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._acking: set[Channel] = set()
        self._channels: dict[int, Channel] = {}
        self._next_channel = 1
        self._opened = False
        self._handshake_waiter: asyncio.Future[Frame] | None = None
        self._handshake_early: list[Frame] = []
        self._closing: asyncio.Future[None] | None = None
        self._heartbeat: int = 0
        self._heartbeat_timer: asyncio.TimerHandle | None = None
        self._received_since_check = True
        self._written_since_check = True
        self._silent_checks = 0
        self.channel_max = 2047
        self.frame_max = _DEFAULT_FRAME_MAX
        self.is_closed = False
        self.close_reason: AmqpError | None = None
        self.close_callbacks: set[Callable[[AmqpError | None], Any]] = set()
        """Called once with the reason (None for our own close) when the connection ends."""
        self.blocked: str | None = None
        """The broker's reason while it blocks this connection's publishes (resource alarm)."""
        self.blocked_callbacks: set[Callable[[str | None], Any]] = set()
        """Called with the reason when the broker blocks the connection, None when it unblocks."""
        self.writes = 0
        """Socket writes so far (one per loop pass that had something to send)."""
        self.server_properties: dict[str, Any] = {}

    # asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; both write alike.
        self._transport = cast(asyncio.Transport, transport)
        self._transport.write(b"AMQP\x00\x00\x09\x01")
        self.writes += 1

    def data_received(self, data: bytes) -> None:
        self._received_since_check = True
        if not self._opened and data.startswith(b"AMQP"):
            self._fail(ConnectionClosed(0, "the broker refused the protocol version"))
            return
        self._reader.feed(data)
        try:
            frames = self._reader.frames()
        except FrameError as error:
            self._fail(ConnectionClosed(501, f"frame error ({error})"))
            return
        channels = self._channels
        for kind, number, payload in frames:
            if number:
                channel = channels.get(number)
                if channel is not None:
                    try:
                        channel.frame_received(kind, payload)
                    except FrameError as error:
                        self._fail(ConnectionClosed(501, f"frame error ({error})"))
                        return
            elif kind == FRAME_METHOD:
                self._connection_method(payload)
            elif kind != FRAME_HEARTBEAT:
                self._fail(ConnectionClosed(505, "unexpected frame on channel 0"))
                return

    def connection_lost(self, exc: Exception | None) -> None:
        reason = self.close_reason
        if reason is None and self._closing is None:
            reason = ConnectionClosed(0, "the connection was lost")
        self._finish(reason)

    # Writing ------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Queue bytes for this loop pass's write (see the module docstring)."""
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def ack_later(self, channel: Channel) -> None:
        """``channel`` has finished deliveries to ack in this loop pass's write."""
        self._acking.add(channel)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._acking:
            acking, self._acking = self._acking, set()
            for channel in acking:
                channel.take_acks(self._out)
        transport = self._transport
        if not self._out or transport is None or transport.is_closing():
            self._out.clear()
            return
        data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out.clear()
        transport.write(data)
        self.writes += 1
        self._written_since_check = True

    # Handshake and channel 0 ---------------------------------------------------------

    def _connection_method(self, payload: bytes) -> None:
        try:
            method = unmarshal_method(payload)
        except FrameError as error:
            self._fail(ConnectionClosed(501, f"frame error ({error})"))
            return
        if isinstance(method, commands.Connection.Close):
            self._send_method(0, commands.Connection.CloseOk())
            self._fail(ConnectionClosed(method.reply_code or 0, method.reply_text or ""))
        elif isinstance(method, commands.Connection.CloseOk):
            if self._transport is not None:
                self._transport.close()
        elif isinstance(method, commands.Connection.Blocked):
            self.blocked = method.reason or "blocked"
            self._tell_blocked()
        elif isinstance(method, commands.Connection.Unblocked):
            self.blocked = None
            self._tell_blocked()
        elif not self._opened:
            waiter = self._handshake_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(method)
            else:
                self._handshake_early.append(method)

    def _tell_blocked(self) -> None:
        for callback in list(self.blocked_callbacks):
            try:
                callback(self.blocked)
            except Exception as exc:
                self._loop.call_exception_handler(
                    {"message": "blocked callback failed", "exception": exc}
                )

    def _send_method(self, channel: int, method: Frame) -> None:
        self.send(pframe.marshal(method, channel))

    async def _open(
        self, settings: ConnectionSettings, name: str | None, heartbeat: int | None
    ) -> None:
        start = await self._next_handshake_frame(commands.Connection.Start)
        assert isinstance(start, commands.Connection.Start)
        self.server_properties = dict(start.server_properties or {})
        mechanisms = (start.mechanisms or "").split()
        if "PLAIN" not in mechanisms:
            raise ConnectionClosed(0, "the broker offers no PLAIN authentication")
        properties: dict[str, Any] = {
            "product": _PRODUCT,
            "platform": f"Python {platform.python_version()}",
            "capabilities": dict(_CAPABILITIES),
        }
        if name:
            properties["connection_name"] = name
        self._send_method(
            0,
            commands.Connection.StartOk(
                client_properties=properties,
                mechanism="PLAIN",
                response=f"\0{settings.username}\0{settings.password}",
                locale="en_US",
            ),
        )
        tune = await self._next_handshake_frame(commands.Connection.Tune)
        assert isinstance(tune, commands.Connection.Tune)
        self.channel_max = tune.channel_max or 2047
        self.frame_max = min(tune.frame_max or _DEFAULT_FRAME_MAX, _DEFAULT_FRAME_MAX)
        self._heartbeat = tune.heartbeat if heartbeat is None else heartbeat
        self._send_method(
            0,
            commands.Connection.TuneOk(
                channel_max=self.channel_max, frame_max=self.frame_max, heartbeat=self._heartbeat
            ),
        )
        self._send_method(0, commands.Connection.Open(virtual_host=settings.vhost))
        await self._next_handshake_frame(commands.Connection.OpenOk)
        self._opened = True
        if self._heartbeat:
            self._heartbeat_timer = self._loop.call_later(self._heartbeat / 2, self._beat)

    async def _next_handshake_frame(self, expected: type[Frame]) -> Frame:
        if self.is_closed:
            raise self.close_reason or ConnectionClosed(0, "the connection was lost")
        if self._handshake_early:
            method = self._handshake_early.pop(0)
        else:
            waiter: asyncio.Future[Frame] = self._loop.create_future()
            self._handshake_waiter = waiter
            method = await waiter
        if not isinstance(method, expected):
            raise ConnectionClosed(0, f"unexpected {method.name} during the handshake")
        return method

    def _closing_future(self) -> asyncio.Future[None]:
        if self._closing is None:
            self._closing = self._loop.create_future()
            if self.is_closed:
                self._closing.set_result(None)
        return self._closing

    # Heartbeats ---------------------------------------------------------------------

    def _beat(self) -> None:
        """Every half interval: a heartbeat frame if nothing else went out, and the
        connection closed when the broker sent nothing for two intervals."""
        if self.is_closed:
            return
        if not self._written_since_check:
            self.send(HEARTBEAT_FRAME)
        self._written_since_check = False
        if self._received_since_check:
            self._silent_checks = 0
        else:
            self._silent_checks += 1
            if self._silent_checks >= 4:
                self._fail(ConnectionClosed(0, "missed heartbeats from the broker"))
                return
        self._received_since_check = False
        self._heartbeat_timer = self._loop.call_later(self._heartbeat / 2, self._beat)

    # Channels -----------------------------------------------------------------------

    async def channel(self, *, publisher_confirms: bool = False) -> Channel:
        """A new open channel, in confirm mode with ``publisher_confirms``."""
        if self.is_closed:
            raise self.close_reason or ConnectionClosed(0, "the connection is closed")
        number = self._allocate_channel()
        channel = Channel(self, number)
        self._channels[number] = channel
        try:
            await channel.open(publisher_confirms=publisher_confirms)
        except BaseException:
            self._channels.pop(number, None)
            raise
        return channel

    def _allocate_channel(self) -> int:
        for _ in range(self.channel_max):
            number = self._next_channel
            self._next_channel = number % self.channel_max + 1
            if number not in self._channels:
                return number
        raise ConnectionClosed(0, "no free channel")

    def channel_closed(self, channel: Channel) -> None:
        if self._channels.get(channel.number) is channel:
            del self._channels[channel.number]

    # Closing ------------------------------------------------------------------------

    async def close(self, timeout: float = 5.0) -> None:
        """Close politely (``connection.close``, then the socket); idempotent."""
        if self.is_closed:
            return
        closed = self._closing_future()
        self._send_method(
            0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(closed), timeout)
        if not self.is_closed:
            self._fail(None)

    def _fail(self, reason: AmqpError | None) -> None:
        if self.close_reason is None:
            self.close_reason = reason
        if self._transport is not None:
            if self._out and not self._transport.is_closing():
                self._flush()  # a close-ok or the last acks, ahead of the close
            self._transport.close()
        self._finish(reason)

    def _finish(self, reason: AmqpError | None) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        if self.close_reason is None:
            self.close_reason = reason
        if self._heartbeat_timer is not None:
            self._heartbeat_timer.cancel()
        error = reason or ConnectionClosed(200, "closed by the client")
        for channel in list(self._channels.values()):
            channel.closed_with(error)
        self._channels.clear()
        waiter = self._handshake_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        closing = self._closing_future()
        if not closing.done():
            closing.set_result(None)
        for callback in list(self.close_callbacks):
            try:
                callback(reason)
            except Exception as exc:  # a callback's failure must not stop the others
                self._loop.call_exception_handler(
                    {"message": "connection close callback failed", "exception": exc}
                )


async def connect(
    url: str,
    *,
    timeout: float = 10.0,
    name: str | None = None,
    heartbeat: int | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Connection:
    """Open a connection (TCP or TLS, the AMQP handshake, PLAIN authentication).

    ``heartbeat`` is the interval this client uses (seconds; None takes the
    broker's, 0 none). An ``amqps://`` URL connects with ``ssl_context``
    (None: the system's CAs, the URL's host name checked). A host name that
    resolves to several addresses (the nodes of a cluster) is tried address
    by address, in the resolver's order, each with the whole ``timeout``:
    a node that drops packets or never answers the handshake costs one
    ``timeout`` and the next address is tried. Raises ``ValueError`` for a
    URL this client does not take, and otherwise the last address's
    ``ConnectionClosed``, ``OSError`` (``ssl.SSLError`` for a refused
    certificate) or ``TimeoutError``; none of them names the URL.
    """
    settings = parse_url(url)
    loop = asyncio.get_running_loop()
    context: ssl.SSLContext | None = None
    if settings.tls:
        context = ssl_context if ssl_context is not None else ssl.create_default_context()
    resolved = await asyncio.wait_for(
        loop.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM), timeout
    )
    addresses = list(dict.fromkeys(info[4][:2] for info in resolved))
    if not addresses:
        raise OSError("the broker's host name resolves to no address")
    failure: BaseException | None = None
    for host, port in addresses:
        try:
            return await _open_at(
                loop, settings, str(host), int(port), context, name, heartbeat, timeout
            )
        except (OSError, TimeoutError, ConnectionClosed) as exc:
            failure = exc
    assert failure is not None
    raise failure


async def _open_at(
    loop: asyncio.AbstractEventLoop,
    settings: ConnectionSettings,
    host: str,
    port: int,
    context: ssl.SSLContext | None,
    name: str | None,
    heartbeat: int | None,
    timeout: float,
) -> Connection:
    """One address: TCP (TLS checked against the URL's host name), then the handshake."""
    connection: Connection | None = None

    async def opening() -> Connection:
        nonlocal connection
        _, protocol = await loop.create_connection(
            lambda: Connection(loop),
            host,
            port,
            ssl=context,
            server_hostname=settings.host if context is not None else None,
        )
        connection = protocol
        await protocol._open(settings, name, heartbeat)
        return protocol

    try:
        return await asyncio.wait_for(opening(), timeout)
    except BaseException:
        if connection is not None and not connection.is_closed:
            connection._fail(ConnectionClosed(0, "the handshake failed"))
        raise
