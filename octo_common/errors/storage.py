"""Authenticated storage errors and configuration errors."""

from __future__ import annotations

from octo_common.errors._base import (
    OctoError,
    StorageError,
)

# Storage -----------------------------------------------------------


class InvalidStorageKey(StorageError):
    _text = "storage key must be 32 bytes"


class InvalidKeyId(StorageError):
    _text = "invalid storage key id"


class InvalidRecordNamespace(StorageError):
    _text = "invalid record namespace"


class InvalidRecordName(StorageError):
    _text = "invalid record name"


class DuplicateKeyId(StorageError):
    _fields = ("key_id",)
    key_id: str


class UnknownKeyId(StorageError):
    _fields = ("key_id",)
    key_id: str


class ActiveKeyCannotBeRetired(StorageError):
    _text = "the active key cannot be retired"


class PayloadTooLarge(StorageError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 2_097_152}
    actual: int
    maximum: int


class RecordTooLarge(StorageError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 3_145_728}
    actual: int
    maximum: int


class EnvelopeEncodingError(StorageError):
    _text = "envelope could not be encoded"


class InvalidEnvelope(StorageError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _text = "invalid storage envelope"
    detail: str


class UnsupportedRecordFormat(StorageError):
    _fields = ("version",)
    version: int


class InvalidRevision(StorageError):
    _text = "revision must be greater than zero"


class RevisionMismatch(StorageError):
    _fields = ("backend", "envelope")
    backend: int
    envelope: int


class InvalidRecordAuthenticationTag(StorageError):
    _text = "record authentication failed"


class RollbackDetected(StorageError):
    _fields = ("record_revision", "revision_floor")
    record_revision: int | None
    revision_floor: int


class RevisionFloorMismatch(StorageError):
    _fields = ("record_revision", "revision_floor")
    record_revision: int | None
    revision_floor: int


class WriteConflict(StorageError):
    _fields = ("expected", "actual", "revision_floor")
    _defaults = {"revision_floor": 0}
    expected: int | None
    actual: int | None
    revision_floor: int


class InvalidReplacementRevision(StorageError):
    _fields = ("expected", "actual")
    expected: int
    actual: int


class FencingRequired(StorageError):
    _fields = ("current",)
    current: int


class InvalidFencingToken(StorageError):
    _text = "fencing token must be greater than zero"


class FencingTokenRejected(StorageError):
    _fields = ("current", "supplied")
    current: int
    supplied: int


class FencingTokenExhausted(StorageError):
    _text = "fencing token would overflow"


class RollbackAnchorMissing(StorageError):
    _text = "rollback anchor file is missing"


class RollbackAnchorInvalid(StorageError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _text = "rollback anchor file is invalid"
    detail: str


class StorageBackendError(StorageError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _text = "storage backend failed"
    detail: str


# Deployment (not a protocol error) -------------------------------------------


class InvalidConfiguration(OctoError):
    """A worker or host configuration file (or a file it names) is unusable.

    ``detail`` names the configuration key and what is wrong with it, in one
    line; it never holds key bytes or passwords.
    """

    _fields = ("detail",)
    _text = "invalid configuration"
    detail: str

    def __str__(self) -> str:
        return f"invalid configuration: {self.detail}"


# Key and secret hygiene: each refusal of a configured key or secret has its
# own code; every one is an ``InvalidConfiguration`` whose detail names the
# configuration key and the file, never its content.


class _SecretRefused(InvalidConfiguration):
    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


class KeyFileNotOwned(_SecretRefused):
    """A key or secret file not owned by the user the process runs as."""


class KeyDirectoryWritable(_SecretRefused):
    """A key or secret file in a directory someone else may write (or own)."""


class KeySharedBetweenRoles(_SecretRefused):
    """One key file, or one key's bytes, configured for two roles."""


class WeakKey(_SecretRefused):
    """A configured key with a visible pattern (all zero, one repeated byte, a run)."""


class BrokerPasswordInline(_SecretRefused):
    """A password inside ``broker.url`` without ``broker.allow_inline_password``."""


class WeakAccessToken(_SecretRefused):
    """An access token with a pattern (fewer than 128 bits of randomness)."""


class ConsoleTlsRequired(_SecretRefused):
    """A console reachable from elsewhere without TLS (here or at a reverse proxy)."""
