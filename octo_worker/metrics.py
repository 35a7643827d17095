"""Prometheus metrics of the worker daemon (``octo_`` prefix).

One ``WorkerMetrics`` object per daemon, on its own registry so tests and
several daemons in one process never collide. Labels carry outcomes, codes,
tools and scopes only: never keys, payloads, operation keys or adapter text.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

__all__ = ["WorkerMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_ADAPTER_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0)


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
            "Reply frames committed but not yet confirmed",
            ["scope"],
            registry=r,
        )
        self.oldest_pending_age = Gauge(
            "octo_oldest_unresolved_pending_seconds",
            "Age of the oldest admission still pending after its handler finished",
            ["scope"],
            registry=r,
        )
        self.last_progress = Gauge(
            "octo_last_progress_timestamp_seconds",
            "Unix time of the last delivery the daemon finished handling",
            registry=r,
        )
        self._pending_since: dict[tuple[str, str], float] = {}

    def note_pending(self, scope: str, key: str, pending: bool) -> None:
        """Track operations left pending (an adapter error or crash) until resolved."""
        slot = (scope, key)
        if pending:
            self._pending_since.setdefault(slot, time.time())
        else:
            self._pending_since.pop(slot, None)
        self.refresh_pending_age(scope)

    def refresh_pending_age(self, scope: str) -> None:
        ages = [time.time() - since for (s, _), since in self._pending_since.items() if s == scope]
        self.oldest_pending_age.labels(scope).set(max(ages) if ages else 0.0)

    def progress(self) -> None:
        self.last_progress.set(time.time())

    def exposition(self) -> bytes:
        """The text exposition format (what a scrape returns)."""
        return bytes(generate_latest(self.registry))

    def serve(self, listen: str) -> None:
        """Start the HTTP endpoint (``HOST:PORT``) in a background thread."""
        host, _, port = listen.rpartition(":")
        start_http_server(int(port), addr=host, registry=self.registry)
