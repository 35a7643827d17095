"""One authenticated session: its driver, decisions, commits and rules.

The package's public names are the session's (``octo_worker.session``):
``session`` builds sessions and drives one handling (the one driver of its
commit, adapter, publish and ack steps); ``decisions`` decides, purely, what
a session answers and returns it as steps (``steps``); ``commits`` submits
its commits in order; ``rules`` and ``request_kinds`` are the pure tables
the decisions read; ``state`` what a session is in memory.
"""

from octo_worker.session.session import (
    Delivery,
    Handled,
    SessionStatus,
    WorkerSession,
    WorkerSessionLimits,
    WorkerSessionStore,
    call_adapter_reporting,
    reply_unresolved,
)

__all__ = [
    "Delivery",
    "Handled",
    "SessionStatus",
    "WorkerSession",
    "WorkerSessionLimits",
    "WorkerSessionStore",
    "call_adapter_reporting",
    "reply_unresolved",
]
