"""One authenticated session: its driver, answers, commits and rules.

The package's public names are the session's (``octo_worker.session``):
``session`` drives one handling; ``answers`` decides what a session answers
under its lock; ``commits`` submits its commits in order; ``rules`` and
``request_kinds`` are the pure tables those decisions read; ``handling`` the
bookkeeping of one handling and the per-key locks.
"""

from octo_worker.session.session import (
    Delivery,
    SessionStatus,
    WorkerSession,
    WorkerSessionLimits,
    WorkerSessionStore,
    call_adapter_reporting,
    reply_unresolved,
)

__all__ = [
    "Delivery",
    "SessionStatus",
    "WorkerSession",
    "WorkerSessionLimits",
    "WorkerSessionStore",
    "call_adapter_reporting",
    "reply_unresolved",
]
