"""Extension points of the worker, named by when they run (``WorkerHooks``).

The session and the daemon call these hooks at fixed points of a
delivery's handling, with typed arguments (scope, message type, keys,
outcomes), never frame bytes. Metrics (:class:`octo_worker.daemon.metrics.WorkerMetrics`)
and fault injection (:class:`octo_worker.daemon.faults.FaultHooks`) are two
implementations; :func:`combine_hooks` runs several in order.

``kind`` is the request's message type as spelled on the wire
(``dispatch_operation``, ``compensate_operation``, ``reconcile_operation``,
``reconcile_compensation``, ``invoke``, ...); ``operation_key`` is the
operation key a keyed request names (also for a compensation and its
lookup), None for other requests.

A hook runs on the event loop, inline: it must return quickly, never
await, never raise, never change what the worker decides, and never see
or log a key, a payload, a frame or adapter text. The fault implementation
is the one exception to "never change": it may kill the process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from octo_common.errors import OctoError

__all__ = ["NO_HOOKS", "WorkerHooks", "combine_hooks"]


class WorkerHooks:
    """Every point at which the worker tells its observers what happened.

    Each method does nothing here: an implementation subclasses this class and
    overrides the points it needs (like dramatiq's middleware).
    """

    def after_admission_commit(self, scope: str, kind: str, operation_key: str) -> None:
        """A dispatch or compensation admission is durable; the delivery is not yet acked."""

    def after_ack(self, scope: str, kind: str, operation_key: str) -> None:
        """The admitted delivery is acked; the adapter has not run."""

    def after_adapter_call(
        self, scope: str, tool: str, method: str, outcome: str, seconds: float
    ) -> None:
        """An adapter method ended: ``outcome`` is ``ok``, the error code the worker
        made of its failure, or ``cancelled`` (the worker is stopping)."""

    def after_effect(self, scope: str, tool: str, method: str) -> None:
        """A method that may have an effect (``invoke``, ``dispatch_operation``,
        ``compensate_operation``) returned; nothing of it is observed yet."""

    def after_commit(self, scope: str, seconds: float) -> None:
        """A commit of a session's state (and its journal rows, outbox) is durable."""

    def on_commit_failed(self, scope: str, error: OctoError) -> None:
        """The store refused or failed a commit with ``error``."""

    def before_reply(
        self, scope: str, kind: str, operation_key: str | None, unresolved: bool | None
    ) -> None:
        """A reply is decided (and committed to the outbox with the journal rows it
        reports); not yet published, so the host cannot have seen it.

        ``unresolved``: what it says of ``operation_key`` (True: still pending
        or running, False: terminal, None: nothing).
        """

    def after_reply(
        self,
        scope: str,
        kind: str,
        operation_key: str | None,
        refused: bool,
        acked: bool,
    ) -> None:
        """The broker confirmed a reply; its outbox row is not yet marked published.

        ``refused``: the reply is a ``request_rejected``. ``acked``: the
        delivery was acked before this reply (an admission), else it is acked
        after it.
        """

    def on_reply_failed(self, scope: str, kind: str) -> None:
        """A reply's publish was not confirmed; it stays in the outbox."""

    def on_dead_letter(self, scope: str, reason: str) -> None:
        """A delivery is about to be dead-lettered with ``reason`` (an error code)."""

    def on_poisoned(self, scope: str, session_id: str) -> None:
        """A session was poisoned by a failed commit; its scope will be reloaded."""

    def after_delivery(self, scope: str, outcome: str) -> None:
        """A delivery's handling ended: ``acked``, ``dead_lettered``, ``requeued`` or
        ``unsettled`` (left to the broker)."""

    def after_outbox_loaded(self, scope: str, rows: int) -> None:
        """A start, reconnect or reload found ``rows`` outbox rows to republish."""

    def after_unresolved_loaded(self, scope: str, since: Mapping[str, float]) -> None:
        """A start or reload found these keys unresolved in the journal (an operation
        or its compensation ``pending`` or ``running``), each with when its row was
        last written (Unix time)."""

    def after_transaction(self, change_sets: int) -> None:
        """The store committed one group-commit transaction of ``change_sets``."""

    def on_consumers_changed(self, active: int) -> None:
        """The number of scopes this worker consumes changed to ``active``."""

    def on_scope_role(self, scope: str, active: bool) -> None:
        """A scope of a shared journal became active here (a fence reserved,
        its sessions restored) or went back to standby (a lost connection)."""


NO_HOOKS: Final = WorkerHooks()

HOOK_NAMES: Final = tuple(
    name for name in vars(WorkerHooks) if name.startswith(("after_", "before_", "on_"))
)


class _Combined(WorkerHooks):
    """Built only by :func:`combine_hooks`, which sets each overridden hook on the instance."""

    def __init__(self, parts: tuple[WorkerHooks, ...]) -> None:
        self.parts = parts
        for name in HOOK_NAMES:
            methods = [getattr(part, name) for part in parts if _overrides(part, name)]
            if len(methods) == 1:
                setattr(self, name, methods[0])
            elif methods:
                setattr(self, name, _in_order(methods))

    def __repr__(self) -> str:
        return f"combine_hooks{self.parts!r}"


def combine_hooks(*parts: WorkerHooks) -> WorkerHooks:
    """One ``WorkerHooks`` that runs each part's hook in the order given.

    A hook no part overrides stays a no-op; a hook only one part overrides
    is that part's own bound method, so combining adds no call on the way.
    """
    if len(parts) == 1:
        return parts[0]
    return _Combined(parts)


def _overrides(part: object, name: str) -> bool:
    own = getattr(type(part), name, None)
    return own is not None and own is not getattr(WorkerHooks, name)


def _in_order(methods: list[Callable[..., None]]) -> Callable[..., None]:
    calls = tuple(methods)

    def run(*args: Any) -> None:
        for call in calls:
            call(*args)

    return run
