"""TLS settings both sides share: what a configuration names, and the ``ssl.SSLContext``.

Owns :class:`TlsSettings` (the CA file, the client or server certificate
and its private key, the server name a client checks) and the two ways it
becomes a context: :meth:`TlsSettings.client_context` (a broker client:
the worker, the host, their commands; whatever carries their AMQP) and
:meth:`TlsSettings.server_context` (the worker's console). The private key
file obeys the one private-file rule (:mod:`octo_common.keyfile`: this
user's, mode 0600, in a directory nobody else may write) before OpenSSL
reads it; certificates and CA files are public and only need to exist.

Errors are ``InvalidConfiguration`` naming the configuration key, in one
line; a failed handshake is described by :func:`describe_tls_failure`, and
a connection the broker ended without saying why (under TLS 1.3 a broker
that wants a client certificate ends the connection after the handshake,
which an AMQP client sees as a reset) by :func:`probe_tls_refusal`, which
opens one TLS connection of its own to read the broker's alert.
It must never weaken verification: a client context always checks the
server's chain and name (TLS 1.2 at least), and no option turns that off.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from octo_common.errors import InvalidConfiguration
from octo_common.keyfile import KeyFileRefused, read_private_file
from octo_common.runtime.keyfiles import refused_file

__all__ = [
    "TlsConfig",
    "TlsSettings",
    "describe_tls_failure",
    "probe_tls_refusal",
    "tls_refusal",
]

# A PEM private key is a few kilobytes; read at most this much to check it.
_KEY_READ_LIMIT = 1 << 20

# The alerts a broker sends when it wants a client certificate it did not get,
# or refuses the one it got (TLS 1.3 and 1.2, OpenSSL's reason names).
_CLIENT_CERTIFICATE_ALERTS = frozenset(
    {
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "SSLV3_ALERT_HANDSHAKE_FAILURE",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "TLSV1_ALERT_UNKNOWN_CA",
        "TLSV1_ALERT_ACCESS_DENIED",
    }
)


class TlsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A ``[broker.tls]`` (or ``[console.tls]``) table: paths as written in the file."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None


class _NamedContext(ssl.SSLContext):
    """A client context that checks the server's certificate against one fixed
    name (``server_name``), whatever host name the connection was opened to."""

    server_name: str

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        return super().wrap_bio(incoming, outgoing, server_side, self.server_name, session)

    def wrap_socket(self, sock: Any, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        kwargs["server_hostname"] = self.server_name
        return super().wrap_socket(sock, *args, **kwargs)


class TlsSettings:
    """Resolved TLS files; ``where`` (``broker.tls``) prefixes every error."""

    @classmethod
    def from_config(
        cls, table: TlsConfig | None, resolve: Callable[[str, str], Path], where: str
    ) -> TlsSettings | None:
        """A ``tls`` table's paths resolved by ``resolve(value, key)`` (None: no TLS)."""
        if table is None:
            return None

        def resolved(value: str | None, name: str) -> Path | None:
            return None if value is None else resolve(value, f"{where}.{name}")

        return cls(
            where=where,
            ca_file=resolved(table.ca_file, "ca_file"),
            cert_file=resolved(table.cert_file, "cert_file"),
            key_file=resolved(table.key_file, "key_file"),
            server_name=table.server_name,
        )

    def __init__(
        self,
        *,
        where: str,
        ca_file: Path | None = None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        server_name: str | None = None,
    ) -> None:
        if (cert_file is None) != (key_file is None):
            raise InvalidConfiguration(f"{where}: cert_file and key_file go together")
        self.where = where
        self.ca_file = ca_file
        self.cert_file = cert_file
        self.key_file = key_file
        self.server_name = server_name

    def __repr__(self) -> str:
        return (
            f"TlsSettings(ca_file={self.ca_file}, cert_file={self.cert_file}, "
            f"server_name={self.server_name!r})"
        )

    def _check_key(self) -> None:
        if self.key_file is None:
            return
        try:
            read_private_file(self.key_file, _KEY_READ_LIMIT)
        except KeyFileRefused as refused:
            raise refused_file(refused, f"{self.where}.key_file") from None

    def _load_chain(self, context: ssl.SSLContext) -> None:
        if self.cert_file is None or self.key_file is None:
            return
        self._check_key()
        try:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        except FileNotFoundError:
            raise InvalidConfiguration(
                f"{self.where}.cert_file: {self.cert_file} does not exist"
            ) from None
        except (ssl.SSLError, OSError) as exc:
            raise InvalidConfiguration(
                f"{self.where}: {self.cert_file} and {self.key_file} are not a certificate"
                f" and its private key ({type(exc).__name__})"
            ) from None

    def client_context(self) -> ssl.SSLContext:
        """A context that verifies the server (the CA file, else the system's CAs),
        its certificate's name being ``server_name`` when set, else the URL's host."""
        if self.server_name is not None:
            named = _NamedContext(ssl.PROTOCOL_TLS_CLIENT)
            named.server_name = self.server_name
            context: ssl.SSLContext = named
        else:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED
        context.check_hostname = True
        if self.ca_file is None:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        else:
            try:
                context.load_verify_locations(cafile=str(self.ca_file))
            except FileNotFoundError:
                raise InvalidConfiguration(
                    f"{self.where}.ca_file: {self.ca_file} does not exist"
                ) from None
            except (ssl.SSLError, OSError) as exc:
                raise InvalidConfiguration(
                    f"{self.where}.ca_file: {self.ca_file} holds no usable CA certificate"
                    f" ({type(exc).__name__})"
                ) from None
        self._load_chain(context)
        return context

    def server_context(self) -> ssl.SSLContext:
        """A server context with this certificate (the console serving HTTPS)."""
        if self.cert_file is None:
            raise InvalidConfiguration(f"{self.where}: a server needs cert_file and key_file")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_chain(context)
        return context


def describe_tls_failure(exc: BaseException) -> str | None:
    """One line for a failed TLS handshake found in ``exc``'s chain, or None if none is.

    A server certificate that does not verify (a wrong CA file, a wrong
    server name) is named as such, so an operator sees which setting to fix.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            reason = current.verify_message or current.reason or "verification failed"
            return (
                f"TLS: the broker's certificate was not accepted ({reason}); check"
                " broker.tls.ca_file and broker.tls.server_name"
            )
        if isinstance(current, ssl.SSLError):
            if current.reason in _CLIENT_CERTIFICATE_ALERTS:
                return (
                    f"TLS: the broker refused this client ({current.reason}); check"
                    " broker.tls.cert_file and broker.tls.key_file (the client certificate)"
                )
            return f"TLS: handshake with the broker failed ({current.reason or 'ssl error'})"
        for arg in getattr(current, "args", ()):
            if isinstance(arg, BaseException) and id(arg) not in seen:
                found = describe_tls_failure(arg)
                if found is not None:
                    return found
        current = current.__cause__ or current.__context__
    return None


async def probe_tls_refusal(url: str, context: ssl.SSLContext, timeout: float) -> str | None:
    """Why a TLS broker at ``url`` ends connections, read from one probe connection:
    the line :func:`describe_tls_failure` gives for the alert the broker sends
    once the handshake is done, or None (no alert within ``timeout``, or not
    reachable at all).

    For a connection that failed without a TLS error in its chain. It never
    sends credentials and never names ``url`` (which may hold a password).
    """
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port or 5671
    except ValueError:
        return None
    if not host:
        return None

    async def attempt() -> None:
        reader, writer = await asyncio.open_connection(host, port, ssl=context)
        try:
            # Nothing is sent: data the broker has not read when it ends the
            # connection would turn its alert into a reset. A broker that
            # accepted this client waits for the AMQP header (until the timeout).
            await reader.read(8)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    try:
        await asyncio.wait_for(attempt(), timeout)
    except ssl.SSLError as error:
        return describe_tls_failure(error)
    except (OSError, TimeoutError, EOFError):
        return None
    return None


async def tls_refusal(
    url: str, context: ssl.SSLContext | None, timeout: float, error: BaseException
) -> str | None:
    """The one line for a failed broker connection's TLS cause, or None: what
    :func:`describe_tls_failure` finds in ``error``'s chain, else (with TLS, a
    connection ended without a reason) what :func:`probe_tls_refusal` reads."""
    found = describe_tls_failure(error)
    if found is not None or context is None:
        return found
    return await probe_tls_refusal(url, context, timeout)
