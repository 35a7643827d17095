"""Prometheus metrics of the worker daemon (``octo_`` prefix), fed by the worker's hooks.

One ``WorkerMetrics`` object per daemon, on its own registry so tests and
several daemons in one process never collide. It is a
:class:`~octo_worker.hooks.WorkerHooks` implementation: the session and the
daemon tell it what happened, with typed arguments, at the points the hooks
name. Labels carry outcomes, codes, tools, scopes and queue names only:
never keys, payloads, operation keys or adapter text. Nothing here does I/O
but the HTTP endpoint; the broker queue gauges are set by
:mod:`octo_worker.daemon.queue_watch`, off the delivery path.

The ``*_for`` methods return a metric's labelled child, remembered per label
tuple: ``labels()`` checks and copies its arguments and takes a lock on
every call, and the per-delivery metrics are touched several times per
operation. Children are never removed from these metrics, so a remembered
child stays the one the registry exposes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Final, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from octo_common.errors import OctoError, SessionReplay
from octo_worker.hooks import WorkerHooks
from octo_worker.session.request_kinds import KEYED_KINDS

__all__ = ["WorkerMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_ADAPTER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0)

_MetricT = TypeVar("_MetricT", Counter, Gauge, Histogram)


class _Children(Generic[_MetricT]):
    """``metric.labels(*values)``, looked up once per distinct label tuple."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: _MetricT) -> None:
        self._metric: _MetricT = metric
        self._cache: dict[tuple[str, ...], _MetricT] = {}

    def __call__(self, *values: str) -> _MetricT:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


# Requests whose admission is counted (the effect kinds), and requests whose
# answer says whether their operation key is resolved (every keyed kind).
_ADMITTED_KINDS: Final = frozenset(name for name, kind in KEYED_KINDS.items() if kind.effect)
_KEYED_KINDS: Final = frozenset(KEYED_KINDS)


class WorkerMetrics(WorkerHooks):
    """Counters, gauges and histograms, updated by the worker's hooks as it works."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.deliveries = Counter(
            "octo_deliveries",
            "Deliveries handled, by scope and outcome",
            ["scope", "outcome"],
            registry=r,
        )
        self.admissions = Counter(
            "octo_admissions",
            "Durable admissions: dispatch (new key) or existing (answered from the journal)",
            ["scope", "kind", "result"],
            registry=r,
        )
        self.adapter_outcomes = Counter(
            "octo_adapter_outcomes",
            "Adapter calls by tool, method and outcome",
            ["tool", "method", "outcome"],
            registry=r,
        )
        self.adapter_duration = Histogram(
            "octo_adapter_duration_seconds",
            "Adapter call duration",
            ["tool", "method"],
            buckets=_ADAPTER_BUCKETS,
            registry=r,
        )
        self.commit_latency = Histogram(
            "octo_journal_commit_seconds",
            "Journal commit latency as seen by a caller",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_batch = Histogram(
            "octo_journal_commit_batch_size",
            "Change sets per group-commit transaction",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.commit_failures = Counter(
            "octo_journal_commit_failures",
            "Journal commits that failed, by error code",
            ["code"],
            registry=r,
        )
        self.frames_rejected = Counter(
            "octo_frames_rejected",
            "Frames dead-lettered, by reason code",
            ["scope", "reason"],
            registry=r,
        )
        self.sessions_poisoned = Counter(
            "octo_sessions_poisoned",
            "Sessions poisoned by a failed commit",
            ["scope"],
            registry=r,
        )
        self.replies = Counter(
            "octo_replies",
            "Reply frames published (confirmed) or failed",
            ["scope", "outcome"],
            registry=r,
        )
        self.consumers_active = Gauge(
            "octo_consumers_active", "Scope consumers currently consuming", registry=r
        )
        self.scope_active = Gauge(
            "octo_scope_active",
            "1 while this worker holds the scope's fence and serves it, 0 in standby",
            ["scope"],
            registry=r,
        )
        self.outbox_pending = Gauge(
            "octo_outbox_pending",
            "Outbox rows found at the last start, reconnect or reload (each republished)",
            ["scope"],
            registry=r,
        )
        self.oldest_pending_age = Gauge(
            "octo_oldest_unresolved_pending_seconds",
            "Age of the oldest key known unresolved (admitted, or pending or running in the "
            "journal at a start), until a terminal answer",
            ["scope"],
            registry=r,
        )
        self.last_progress = Gauge(
            "octo_last_progress_timestamp_seconds",
            "Unix time of the last delivery the daemon finished handling",
            registry=r,
        )
        self.queue_messages = Gauge(
            "octo_queue_messages",
            "Ready messages in each scope's worker queue and in octo.v5.dead at the last "
            "refresh (passive declare; absent while the queue does not exist)",
            ["queue"],
            registry=r,
        )
        self.queue_consumers = Gauge(
            "octo_queue_consumers",
            "Consumers of each scope's worker queue and of octo.v5.dead at the last refresh, "
            "every worker's (0 while the queue does not exist)",
            ["queue"],
            registry=r,
        )
        self.queue_refreshed = Gauge(
            "octo_queue_refresh_timestamp_seconds",
            "Unix time of the last successful refresh of the queue gauges",
            registry=r,
        )
        # scope -> operation key -> when it was first noted pending.
        self._pending_since: dict[str, dict[str, float]] = {}
        self._pending_gauges: set[str] = set()
        self._admissions = _Children(self.admissions)
        self._adapter_outcomes = _Children(self.adapter_outcomes)
        self._adapter_duration = _Children(self.adapter_duration)
        self._deliveries = _Children(self.deliveries)
        self._frames_rejected = _Children(self.frames_rejected)
        self._replies = _Children(self.replies)
        self._oldest_pending_age = _Children(self.oldest_pending_age)

    # Labelled children, remembered (see the module docstring).

    def admissions_for(self, scope: str, kind: str, result: str) -> Counter:
        """``admissions.labels(scope, kind, result)``."""
        return self._admissions(scope, kind, result)

    def adapter_outcomes_for(self, tool: str, method: str, outcome: str) -> Counter:
        """``adapter_outcomes.labels(tool, method, outcome)``."""
        return self._adapter_outcomes(tool, method, outcome)

    def adapter_duration_for(self, tool: str, method: str) -> Histogram:
        """``adapter_duration.labels(tool, method)``."""
        return self._adapter_duration(tool, method)

    def deliveries_for(self, scope: str, outcome: str) -> Counter:
        """``deliveries.labels(scope, outcome)``."""
        return self._deliveries(scope, outcome)

    def frames_rejected_for(self, scope: str, reason: str) -> Counter:
        """``frames_rejected.labels(scope, reason)``."""
        return self._frames_rejected(scope, reason)

    def replies_for(self, scope: str, outcome: str) -> Counter:
        """``replies.labels(scope, outcome)``."""
        return self._replies(scope, outcome)

    def note_pending(self, scope: str, key: str, pending: bool) -> None:
        """Track a key acked (admitted) and not yet answered until it is resolved.

        Resolved: a reply about to be published that reports it terminal (a
        result, or a reconciliation or lookup that found it so). The scope's
        gauge is read at scrape time, so it keeps growing while a key stays
        unresolved.
        """
        slots = self._pending_since.get(scope)
        if pending:
            if slots is None:
                slots = self._pending_since[scope] = {}
            slots.setdefault(key, time.time())
        elif slots is not None:
            slots.pop(key, None)
            if not slots:
                del self._pending_since[scope]
        if scope not in self._pending_gauges:
            self._pending_gauges.add(scope)
            self._oldest_pending_age(scope).set_function(lambda: self.oldest_pending_age_of(scope))

    def after_unresolved_loaded(self, scope: str, since: Mapping[str, float]) -> None:
        """Count every key the journal holds unresolved at a start or reload, from
        its row's last write, whether or not a request names it again."""
        for key, written in since.items():
            self.note_pending(scope, key, True)
            slots = self._pending_since[scope]
            slots[key] = min(slots[key], written)

    def oldest_pending_age_of(self, scope: str) -> float:
        """Seconds since the oldest unresolved key of ``scope`` was admitted (0 if none)."""
        # Called by the scrape thread while the loop may change the slots:
        # one copy (a single C-level call, atomic under the GIL), then read it.
        slots = self._pending_since.get(scope)
        since = list(slots.values()) if slots is not None else []
        return time.time() - min(since) if since else 0.0

    def progress(self) -> None:
        self.last_progress.set(time.time())

    def note_queue(self, queue: str, messages: int | None, consumers: int | None) -> None:
        """One queue's counts at a refresh; None for both when the queue is missing."""
        if messages is None:
            with contextlib.suppress(KeyError):
                self.queue_messages.remove(queue)
        else:
            self.queue_messages.labels(queue).set(messages)
        self.queue_consumers.labels(queue).set(consumers or 0)

    def note_queues_refreshed(self) -> None:
        self.queue_refreshed.set(time.time())

    # Hooks (octo_worker.hooks): what each point of a delivery's handling counts.

    def after_ack(self, scope: str, kind: str, operation_key: str) -> None:
        self._admissions(scope, _short(kind), "dispatch").inc()
        self.note_pending(scope, operation_key, True)

    def after_adapter_call(
        self, scope: str, tool: str, method: str, outcome: str, seconds: float
    ) -> None:
        self._adapter_outcomes(tool, method, outcome).inc()
        self._adapter_duration(tool, method).observe(seconds)

    def after_commit(self, scope: str, seconds: float) -> None:
        self.commit_latency.observe(seconds)

    def on_commit_failed(self, scope: str, error: OctoError) -> None:
        # An open_session for a session id the scope already has is refused by
        # the store, as it must be: no journal failure.
        if not isinstance(error, SessionReplay):
            self.commit_failures.labels(error.code).inc()

    def before_reply(
        self, scope: str, kind: str, operation_key: str | None, unresolved: bool | None
    ) -> None:
        # Before the publish: once the host can see a terminal answer, the key no
        # longer counts, and it stops counting even if the broker never confirms
        # the reply (the journal holds it terminal, as a restart would find it).
        if kind in _KEYED_KINDS and operation_key is not None and unresolved is not None:
            self.note_pending(scope, operation_key, unresolved)

    def after_reply(
        self,
        scope: str,
        kind: str,
        operation_key: str | None,
        refused: bool,
        acked: bool,
    ) -> None:
        self._replies(scope, "confirmed").inc()
        if kind in _ADMITTED_KINDS and not acked:
            # Answered before any ack: an existing record or a refusal.
            self._admissions(scope, _short(kind), "refused" if refused else "existing").inc()

    def on_reply_failed(self, scope: str, kind: str) -> None:
        self._replies(scope, "failed").inc()

    def on_dead_letter(self, scope: str, reason: str) -> None:
        self._frames_rejected(scope, reason).inc()

    def on_poisoned(self, scope: str, session_id: str) -> None:
        self.sessions_poisoned.labels(scope).inc()

    def after_delivery(self, scope: str, outcome: str) -> None:
        self._deliveries(scope, outcome).inc()
        self.progress()

    def after_outbox_loaded(self, scope: str, rows: int) -> None:
        self.outbox_pending.labels(scope).set(rows)

    def after_transaction(self, change_sets: int) -> None:
        self.commit_batch.observe(change_sets)

    def on_consumers_changed(self, active: int) -> None:
        self.consumers_active.set(active)

    def on_scope_role(self, scope: str, active: bool) -> None:
        self.scope_active.labels(scope).set(1 if active else 0)

    # Exposition.

    def exposition(self) -> bytes:
        """The text exposition format (what a scrape returns)."""
        return bytes(generate_latest(self.registry))

    def serve(self, listen: str) -> None:
        """Start the HTTP endpoint (``HOST:PORT``) in a background thread."""
        host, _, port = listen.rpartition(":")
        start_http_server(int(port), addr=host, registry=self.registry)


def _short(kind: str) -> str:
    return "compensation" if kind == "compensate_operation" else "operation"
