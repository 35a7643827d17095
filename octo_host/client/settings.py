"""The host client's tunables: one object shared by the client's parts.

:class:`~octo_host.client.HostClient` builds it from its arguments and its
attributes of the same names read and write it, so a change (the CLI sets
``publish_timeout`` after ``start``) reaches every part at once.

It must never hold state other than these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClientSettings"]


@dataclass(slots=True)
class ClientSettings:
    """Timeouts (seconds), attempts and bounds of one host client."""

    reply_timeout: float
    """How long a request waits for its reply before it counts as unanswered."""
    publish_timeout: float
    """How long one publish waits for the broker's confirm."""
    max_attempts: int
    """Requests per verb (the first and its repetitions), at least 1."""
    backoff_initial: float
    """The pause before the second attempt; it doubles up to ``backoff_max``."""
    backoff_max: float
    max_cached_runs: int
    """Runs kept loaded, at least 1 (see ``RunCache``)."""
    session_rotate_after: int = 768
    """A pooled session is rotated out once it may hold this many request ids
    (the worker retains at most 1,024 per session, ``SessionPools``)."""
    session_max_in_flight: int = 256
    """Verbs one pooled session carries at once before the pool opens another."""
    session_pool_size: int = 4
    """Sessions a scope's pool keeps open at most for busy verbs (rotated ones apart)."""
    payload_codec: bool = True
    """New sessions send and take every frame after open_session encrypted
    (``octo_common.framecipher``); the broker holds ciphertext only."""
