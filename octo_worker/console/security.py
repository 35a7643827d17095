"""Who may reach the console: the bind address, the access token, the Host header.

Rules (fail closed):

* The console binds a loopback address unless ``allow_remote`` is set, an
  access-token file is configured, and the console serves HTTPS itself
  (``[console.tls]`` cert and key) or stands behind a reverse proxy that
  does (``behind_proxy``); anything else is refused before a socket is
  opened (``InvalidConfiguration``; without TLS, ``console_tls_required``).
* The token file follows the key-file rules (regular file, no symlink, no
  group or other permission bits, this user's, see ``octo_common.keyfile``)
  and holds one token of at least 128 bits of randomness, as
  ``octo-worker console-token`` writes (a token with a pattern, such as 32
  "A"s, is ``weak_access_token``). When it is configured every request
  must carry the token (``Authorization: Bearer``) or a session cookie; it
  is compared in constant time.
* A ``?token=`` visit is traded for a session cookie: a random id (256
  bits) known to this process only, ``Secure``, ``HttpOnly``,
  ``SameSite=Strict``, expiring after ``session_minutes``; it says nothing
  about the token, and a restart forgets every session.
* Without a token (loopback only), a request must name a loopback host in
  its ``Host`` header, so that a web page elsewhere cannot reach the console
  through a DNS name rebound to 127.0.0.1.

This module never logs or returns the token, and never puts it in a URL it
builds.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import itertools
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from octo_common.errors import ConsoleTlsRequired, WeakAccessToken
from octo_common.runtime.keyfiles import read_secret_text
from octo_worker.config import InvalidConfiguration

__all__ = [
    "COOKIE",
    "AccessToken",
    "BindAddress",
    "ConsoleSessions",
    "generate_token",
    "token_bits",
    "check_bind",
    "is_loopback_host",
    "load_token",
    "parse_listen",
]

COOKIE: Final = "octo_console"
_MIN_TOKEN_LENGTH: Final = 32
# What a token must carry, estimated from its own characters (see token_bits).
MIN_TOKEN_BITS: Final = 128
# Sessions a console holds at once; the oldest goes first beyond this.
_MAX_SESSIONS: Final = 1024


@dataclass(frozen=True)
class BindAddress:
    host: str
    port: int

    def url(self, scheme: str = "http") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/"


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


def check_bind(
    address: BindAddress,
    *,
    allow_remote: bool,
    token_configured: bool,
    tls: bool = False,
    behind_proxy: bool = False,
) -> None:
    """Refuse a non-loopback bind unless remote access is allowed, a token is
    configured, and the traffic is encrypted (HTTPS here, or at a reverse proxy)."""
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
    if not (tls or behind_proxy):
        raise ConsoleTlsRequired(
            f"console: listening on {address.host} needs TLS: [console.tls] cert_file and"
            " key_file (--tls-cert/--tls-key), or behind_proxy (--behind-proxy) when a"
            " reverse proxy serves it over HTTPS"
        )


def token_bits(token: str) -> float:
    """A lower estimate of the randomness in ``token``, in bits.

    The empirical entropy of its characters times its length; a token whose
    neighbours differ by at most two distinct steps (``AAAA...``,
    ``ABCD...``, ``ABAB...``) carries none.
    """
    if not token:
        return 0.0
    steps = {ord(b) - ord(a) for a, b in itertools.pairwise(token)}
    if len(steps) <= 2:
        return 0.0
    counts = collections.Counter(token)
    size = len(token)
    per_char = -sum(n / size * math.log2(n / size) for n in counts.values())
    return per_char * size


def generate_token() -> str:
    """A fresh access token: 256 random bits, URL-safe (43 characters)."""
    while True:
        token = secrets.token_urlsafe(32)
        if token_bits(token) >= MIN_TOKEN_BITS:
            return token


class ConsoleSessions:
    """The session cookies a console handed out: random ids, each with its expiry.

    Held in this process only (a restart logs everyone out); at most
    ``_MAX_SESSIONS``, the oldest dropped first; an expired id is refused
    and forgotten.
    """

    def __init__(self, lifetime_seconds: float) -> None:
        self.lifetime_seconds = lifetime_seconds
        self._expiry: collections.OrderedDict[str, float] = collections.OrderedDict()

    def __repr__(self) -> str:
        return f"ConsoleSessions({len(self._expiry)} held)"

    def issue(self) -> str:
        now = time.monotonic()
        while self._expiry and (
            len(self._expiry) >= _MAX_SESSIONS or next(iter(self._expiry.values())) <= now
        ):
            self._expiry.popitem(last=False)
        session = secrets.token_urlsafe(32)
        self._expiry[session] = now + self.lifetime_seconds
        return session

    def valid(self, presented: str | None) -> bool:
        if not presented:
            return False
        expiry = self._expiry.get(presented)
        if expiry is None:
            return False
        if expiry <= time.monotonic():
            del self._expiry[presented]
            return False
        return True


class AccessToken:
    """The configured token; compares what a request presents in constant time."""

    def __init__(self, token: str) -> None:
        self._token = token.encode("ascii")

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


def load_token(path: Path, where: str) -> AccessToken:
    """The token file, under the key-file rules: one token of at least 32 printable
    ASCII characters carrying at least 128 bits (``weak_access_token`` otherwise)."""
    text = read_secret_text(path, where)
    if len(text) < _MIN_TOKEN_LENGTH or not all(0x21 <= ord(c) <= 0x7E for c in text):
        raise InvalidConfiguration(
            f"{where}: {path} must hold one token of at least {_MIN_TOKEN_LENGTH} printable "
            "ASCII characters (octo-worker console-token writes one)"
        )
    if token_bits(text) < MIN_TOKEN_BITS:
        raise WeakAccessToken(
            f"{where}: {path} holds a token with a pattern (under {MIN_TOKEN_BITS} bits of"
            " randomness); octo-worker console-token writes a random one"
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
