"""The host client: sessions, durable runs, confirmed publishes and reply routing.

:class:`HostClient` is the public object; its parts are
one module each: ``broker`` (the AMQP side), ``sessions``, ``runs``,
``verbs``, ``replies``, ``recovery``, and ``facade`` (``HostClient`` itself,
wiring them). The decisions they apply are pure modules of their own:
:mod:`octo_host.engine` (what is sealed and applied), :mod:`octo_host.reactions`
(what a refusal or a reply leads to) and :mod:`octo_common.inbound` (where a
delivery goes).

The client must never send a second ``dispatch_operation`` for a key the
worker may have admitted, create a new key to make progress, publish a frame
before the ledger revision that justifies it is durable, seal a compensation
without a fresh approval, persist or reuse a session, or log keys, nonces,
payloads or adapter text. It does not import :mod:`octo_worker`.
"""

from octo_host.client.facade import HostClient
from octo_host.client.recovery import RecoverySummary
from octo_host.client.runs import (
    ROUTES_NAMESPACE,
    DispatchScopeMismatch,
    HostRun,
    routes_record_key,
)
from octo_host.client.sessions import HostSession, ReplyCut, ReplyTimedOut

__all__ = [
    "ROUTES_NAMESPACE",
    "DispatchScopeMismatch",
    "HostClient",
    "HostRun",
    "HostSession",
    "RecoverySummary",
    "ReplyCut",
    "ReplyTimedOut",
    "routes_record_key",
]
