"""An incremental, order-independent digest of a set of (namespace, name, revision) rows.

This module owns :class:`SetDigest`, the digest a store keeps beside its rows
so that one sealed value commits to every row it holds: a write updates it in
O(1) (remove the row's old element, add its new one), and whoever holds the
rows can recompute it from scratch (once, at open) and compare. The host
ledger's store head is one user (``octo_host.storage.head``); any other store
may be another, under a domain of its own.

Construction (an additive multiset hash, "AdHash" over Z/2^4096):

* ``element = BLAKE3-XOF("octo-set-digest-v1" ‖ LP(domain) ‖ LP(utf8(namespace))
  ‖ LP(utf8(name)) ‖ BE64(revision))``, the first 512 bytes, read as a
  big-endian integer (``LP`` and ``BE64`` as in :mod:`octo_common.digest`);
* ``digest = Σ elements mod 2^4096``, serialised as 512 big-endian bytes, with
  the number of elements kept beside it;
* ``fingerprint = BLAKE3("octo-set-digest-fingerprint-v1" ‖ LP(domain) ‖
  BE64(count) ‖ digest bytes)``, 32 bytes, for places that only compare.

Why this is enough. Addition commutes, so the digest does not depend on the
order rows were written in, and ``remove`` is subtraction, so an update
costs two element hashes whatever the number of rows. The ``domain`` keeps
the digests of different uses (and of different scopes, if a user puts the
scope in it) apart. A forger must find a second set of rows with the same
sum. The best known attack on an additive hash modulo 2^n, Wagner's
generalised birthday (k-tree) algorithm, costs about 2^(2·sqrt(n)) even
when the attacker may choose elements freely: 2^128 for n = 4096, which is
why the modulus is 2^4096 and not 2^256 (2^256 is within reach of that
attack, on the order of 2^32 work, for an attacker who holds a few hundred
old versions of each of some tens of thousands of rows). Users of this
module are far better placed: the elements an attacker can put in a
database are only the authentic sealed row versions that once existed (the
store authenticates every row), at most one per (namespace, name) (a
primary key), so the lists the attack needs are as short as the rows'
histories. The digest is unkeyed and never secret: the seal of the head
that holds it is what an attacker cannot forge.

It is pure: no I/O, no keys, no clock. It validates only argument types and
ranges (``TypeError`` / ``ValueError``: a caller's defect, not input); a
digest read from storage is rebuilt with :meth:`SetDigest.from_bytes`,
which refuses a value of the wrong length. It must never depend on the order
of updates or skip an element.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import blake3

from octo_common.digest import be64, lp
from octo_common.limits import MAX_U64

__all__ = [
    "SET_DIGEST_BITS",
    "SET_DIGEST_BYTES",
    "SET_DIGEST_DOMAIN",
    "SET_DIGEST_FINGERPRINT_DOMAIN",
    "SetDigest",
    "element_value",
]

SET_DIGEST_DOMAIN: Final = b"octo-set-digest-v1"
SET_DIGEST_FINGERPRINT_DOMAIN: Final = b"octo-set-digest-fingerprint-v1"
SET_DIGEST_BITS: Final = 4096
SET_DIGEST_BYTES: Final = SET_DIGEST_BITS // 8
_MASK: Final = (1 << SET_DIGEST_BITS) - 1


def _check_domain(domain: object) -> bytes:
    if not isinstance(domain, bytes) or not domain:
        raise TypeError("set digest domain must be non-empty bytes")
    return domain


def _element_bytes(domain: bytes, namespace: object, name: object, revision: object) -> bytes:
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise TypeError("set digest namespace and name must be str")
    if type(revision) is not int:
        raise TypeError("set digest revision must be an int")
    if not 0 <= revision <= MAX_U64:
        raise ValueError("set digest revision must be in 0..2^64-1")
    return b"".join(
        (
            SET_DIGEST_DOMAIN,
            lp(domain),
            lp(namespace.encode("utf-8")),
            lp(name.encode("utf-8")),
            be64(revision),
        )
    )


def element_value(domain: bytes, namespace: str, name: str, revision: int) -> int:
    """The element of row (namespace, name, revision) under ``domain``: an int below 2^4096."""
    message = _element_bytes(_check_domain(domain), namespace, name, revision)
    output = blake3.blake3(message).digest(length=SET_DIGEST_BYTES)
    return int.from_bytes(output, "big")


class SetDigest:
    """The digest of a multiset of (namespace, name, revision) rows under one domain.

    Mutable: :meth:`add`, :meth:`remove` and :meth:`replace` change it in
    place, each in O(1). Two digests are equal when their domain, count and
    sum are. A multiset: adding a row twice counts it twice; callers hold each
    (namespace, name) at most once, so a row's digest changes exactly when the
    row does.
    """

    __slots__ = ("_count", "_domain", "_value")

    def __init__(self, domain: bytes) -> None:
        """The digest of the empty set under ``domain``."""
        self._domain = _check_domain(domain)
        self._value = 0
        self._count = 0

    @classmethod
    def from_bytes(cls, domain: bytes, value: bytes, count: int) -> SetDigest:
        """Rebuild a digest from :meth:`to_bytes` and :attr:`count` (e.g. read from a store).

        ``value`` must be exactly 512 bytes and ``count`` in 0..2^64-1, else
        ``ValueError``.
        """
        digest = cls(domain)
        if not isinstance(value, bytes):
            raise TypeError("set digest value must be bytes")
        if len(value) != SET_DIGEST_BYTES:
            raise ValueError(f"set digest value must be {SET_DIGEST_BYTES} bytes")
        if type(count) is not int:
            raise TypeError("set digest count must be an int")
        if not 0 <= count <= MAX_U64:
            raise ValueError("set digest count must be in 0..2^64-1")
        digest._value = int.from_bytes(value, "big")
        digest._count = count
        return digest

    @classmethod
    def of(cls, domain: bytes, rows: Iterable[tuple[str, str, int]]) -> SetDigest:
        """The digest of ``rows`` computed from scratch (O(len(rows)))."""
        digest = cls(domain)
        total = 0
        count = 0
        for namespace, name, revision in rows:
            total += element_value(domain, namespace, name, revision)
            count += 1
        digest._value = total & _MASK
        digest._count = count
        return digest

    @property
    def domain(self) -> bytes:
        """The domain every element of this digest is hashed under."""
        return self._domain

    @property
    def count(self) -> int:
        """How many rows the digest holds."""
        return self._count

    def add(self, namespace: str, name: str, revision: int) -> None:
        """Add the row (namespace, name, revision)."""
        element = element_value(self._domain, namespace, name, revision)
        if self._count >= MAX_U64:
            raise ValueError("set digest count would pass 2^64-1")
        self._value = (self._value + element) & _MASK
        self._count += 1

    def remove(self, namespace: str, name: str, revision: int) -> None:
        """Remove the row (namespace, name, revision); the caller knows it is there.

        Removing from an empty digest is ``ValueError``. Removing a row that
        was never added is not detected here: the digest then no longer
        matches the rows, which a recomputation shows.
        """
        element = element_value(self._domain, namespace, name, revision)
        if self._count == 0:
            raise ValueError("set digest is empty")
        self._value = (self._value - element) & _MASK
        self._count -= 1

    def replace(
        self, namespace: str, name: str, old_revision: int | None, new_revision: int | None
    ) -> None:
        """One row's change: its ``old_revision`` (None: it did not exist) becomes
        ``new_revision`` (None: it no longer exists)."""
        if old_revision is not None:
            self.remove(namespace, name, old_revision)
        if new_revision is not None:
            self.add(namespace, name, new_revision)

    def to_bytes(self) -> bytes:
        """The sum as 512 big-endian bytes (the count is kept separately)."""
        return self._value.to_bytes(SET_DIGEST_BYTES, "big")

    def fingerprint(self) -> bytes:
        """32 bytes that change whenever domain, count or sum does (for comparing only)."""
        message = b"".join(
            (SET_DIGEST_FINGERPRINT_DOMAIN, lp(self._domain), be64(self._count), self.to_bytes())
        )
        return bytes(blake3.blake3(message).digest())

    def copy(self) -> SetDigest:
        """An independent copy."""
        twin = SetDigest(self._domain)
        twin._value = self._value
        twin._count = self._count
        return twin

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SetDigest):
            return NotImplemented
        return (self._domain, self._count, self._value) == (
            other._domain,
            other._count,
            other._value,
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"SetDigest(count={self._count}, fingerprint={self.fingerprint().hex()[:16]}...)"
