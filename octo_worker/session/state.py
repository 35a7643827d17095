"""What one worker session is in memory: :class:`SessionState`.

The session's identity (scope, id, key nonce, reply queue, manifest), its
authenticator (replay window, outbound sequence), its authorizer (budgets,
request ids), its status and its reconciliation counters. The session's
driver and its answers share this one object; only the answers and the
commit pipeline's go-back change it, under the session lock.

Pure: it holds values and does no I/O. It must never hold a key in a
field its repr shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octo_common.authorizer import SessionAuthorizer
from octo_common.frames import SessionAuthenticator
from octo_common.grants import CapabilityManifest
from octo_worker.storage.documents import SessionStatus

__all__ = ["SessionState"]


@dataclass(eq=False)
class SessionState:
    """One session's identity and protocol state (see the module docstring)."""

    scope: str
    session_id: str
    key_nonce: bytes = field(repr=False)
    reply_to: str
    manifest: CapabilityManifest = field(repr=False)
    authenticator: SessionAuthenticator = field(repr=False)
    authorizer: SessionAuthorizer = field(repr=False)
    status: SessionStatus
    reconciliations_total: int
    reconciliations_by_tool: dict[str, int]
