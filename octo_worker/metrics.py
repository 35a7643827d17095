"""Prometheus metrics of the worker daemon (``octo_`` prefix).

One ``WorkerMetrics`` object per daemon, on its own registry so tests and
several daemons in one process never collide. Labels carry outcomes, codes,
tools, scopes and queue names only: never keys, payloads, operation keys or
adapter text. Nothing here does I/O but the HTTP endpoint; the broker queue
gauges are set by :mod:`octo_worker.queue_watch`, off the delivery path.

The ``*_for`` methods return a metric's labelled child, remembered per label
tuple: ``labels()`` checks and copies its arguments and takes a lock on
every call, and the per-delivery metrics are touched several times per
operation. Children are never removed from these metrics, so a remembered
child stays the one the registry exposes.
"""

from __future__ import annotations

import contextlib
import time
from typing import Final, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

__all__ = ["WorkerMetrics", "unresolved_after_reply"]

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


class WorkerMetrics:
    """Counters, gauges and histograms the daemon updates as it works."""

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
        self.outbox_pending = Gauge(
            "octo_outbox_pending",
            "Outbox rows found at the last start, reconnect or reload (each republished)",
            ["scope"],
            registry=r,
        )
        self.oldest_pending_age = Gauge(
            "octo_oldest_unresolved_pending_seconds",
            "Age of the oldest admission (since this start) not yet answered or reconciled",
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

        Resolved: a reply other than a refusal to its dispatch or compensation,
        or a reconciliation that found it terminal. The scope's gauge is read
        at scrape time, so it keeps growing while a key stays unresolved.
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

    def exposition(self) -> bytes:
        """The text exposition format (what a scrape returns)."""
        return bytes(generate_latest(self.registry))

    def serve(self, listen: str) -> None:
        """Start the HTTP endpoint (``HOST:PORT``) in a background thread."""
        host, _, port = listen.rpartition(":")
        start_http_server(int(port), addr=host, registry=self.registry)


_REJECTED: Final = b'"type":"request_rejected"'
# Refusals that say the journal holds the key pending (D5, W§10.6).
_PENDING_REFUSALS: Final = (b'"code":"pending_operation"', b'"code":"pending_compensation"')
_STATUS: Final = b'"status":{"state":"'
_TERMINAL_STATES: Final = frozenset({b"succeeded", b"failed", b"cancelled"})


def unresolved_after_reply(frame: bytes) -> bool | None:
    """What a reply to a keyed request or a reconciliation says of its key.

    True: still unresolved (a status ``running``, or a refusal saying the
    journal holds the key pending, which is how a key a crash left pending
    shows up after a restart); False: resolved (a terminal status); None:
    nothing (any other refusal). Reads the canonical reply frame without
    decoding it: every field before a result's ``status`` is a token or a
    number, so the first ``status`` is the result's own.
    """
    if _REJECTED in frame:
        return True if any(code in frame for code in _PENDING_REFUSALS) else None
    start = frame.find(_STATUS)
    if start < 0:
        return None
    start += len(_STATUS)
    end = frame.find(b'"', start, start + 20)
    if end < 0:
        return None
    return frame[start:end] not in _TERMINAL_STATES
