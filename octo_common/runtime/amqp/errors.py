"""What the lean AMQP client raises: a connection or a channel that ended.

Both carry the broker's reply code and text (``reply_code`` 0 when the
client itself ended it); neither ever carries a URL or credentials.
"""

from __future__ import annotations

__all__ = ["AmqpError", "ChannelClosed", "ConnectionClosed"]


class AmqpError(Exception):
    """A connection or channel ended (``reply_code``, ``reply_text``)."""

    def __init__(self, reply_code: int, reply_text: str) -> None:
        super().__init__(f"{reply_code} {reply_text}".strip())
        self.reply_code = reply_code
        self.reply_text = reply_text


class ConnectionClosed(AmqpError):
    """The connection ended: every channel on it ended with it."""


class ChannelClosed(AmqpError):
    """The channel ended (the broker closed it, e.g. 404 for a missing queue or
    exchange, 406 for a declaration that differs, or its connection ended)."""
