"""Who may reach the console: the bind address, the access token, the Host header.

Rules (fail closed):

* The console binds a loopback address unless ``allow_remote`` is set AND an
  access-token file is configured; anything else is refused before a socket
  is opened (``InvalidConfiguration``).
* The token file follows the key-file rules (regular file, no symlink, no
  group or other permission bits, see ``octo_worker.config``) and holds at
  least 32 printable ASCII characters. When it is configured every request
  must carry the token (``Authorization: Bearer``, or the cookie that a
  ``?token=`` visit sets); it is compared in constant time.
* Without a token (loopback only), a request must name a loopback host in
  its ``Host`` header, so that a web page elsewhere cannot reach the console
  through a DNS name rebound to 127.0.0.1.

This module never logs or returns the token, and never puts it in a URL it
builds.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from octo_common.runtime.keyfiles import read_secret_text
from octo_worker.config import InvalidConfiguration

__all__ = [
    "COOKIE",
    "AccessToken",
    "BindAddress",
    "check_bind",
    "is_loopback_host",
    "load_token",
    "parse_listen",
]

COOKIE: Final = "octo_console"
_MIN_TOKEN_LENGTH: Final = 32
_COOKIE_CONTEXT: Final = b"octo-console cookie v1"


@dataclass(frozen=True)
class BindAddress:
    host: str
    port: int

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


def parse_listen(text: str, where: str) -> BindAddress:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6); port 0 asks for a free one."""
    host, _, port = text.rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidConfiguration(f"{where}: expected HOST:PORT, got {text!r}")
    return BindAddress(host, int(port))


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP literal (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(address: BindAddress, *, allow_remote: bool, token_configured: bool) -> None:
    """Refuse a non-loopback bind unless remote access is allowed and a token is configured."""
    if is_loopback_host(address.host):
        return
    if not allow_remote:
        raise InvalidConfiguration(
            f"console: refusing to listen on {address.host} (not a loopback address): "
            "use an SSH tunnel, or set allow_remote (--allow-remote) with a token_file"
        )
    if not token_configured:
        raise InvalidConfiguration(
            f"console: listening on {address.host} needs an access token "
            "(console.token_file / --token-file)"
        )


class AccessToken:
    """The configured token; compares what a request presents in constant time."""

    def __init__(self, token: str) -> None:
        self._token = token.encode("ascii")
        self._cookie = hmac.new(self._token, _COOKIE_CONTEXT, hashlib.sha256).hexdigest()

    def __repr__(self) -> str:
        return "AccessToken(<redacted>)"

    def matches(self, presented: str | None) -> bool:
        if presented is None:
            return False
        try:
            candidate = presented.encode("ascii")
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(candidate, self._token)

    @property
    def cookie_value(self) -> str:
        """What the cookie holds: derived from the token, never the token itself."""
        return self._cookie

    def cookie_matches(self, presented: str | None) -> bool:
        if presented is None:
            return False
        try:
            candidate = presented.encode("ascii")
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(candidate, self._cookie.encode("ascii"))


def load_token(path: Path, where: str) -> AccessToken:
    """The token file, under the key-file rules; at least 32 printable ASCII characters."""
    text = read_secret_text(path, where)
    if len(text) < _MIN_TOKEN_LENGTH or not all(0x21 <= ord(c) <= 0x7E for c in text):
        raise InvalidConfiguration(
            f"{where}: {path} must hold one token of at least {_MIN_TOKEN_LENGTH} printable "
            "ASCII characters (for example: head -c 32 /dev/urandom | base64)"
        )
    return AccessToken(text)


def host_of(header: str | None) -> str | None:
    """The host part of a ``Host`` header (``[::1]:8080`` -> ``::1``)."""
    if not header:
        return None
    header = header.strip()
    if header.startswith("["):
        end = header.find("]")
        return header[1:end] if end > 0 else None
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header
