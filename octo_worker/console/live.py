"""The live view's numbers: the daemon's delivery counters, by scope and outcome,
and the broker queue gauges (depth and consumers) the daemon refreshes.

Served by the daemon (``[console] listen``), the console reads the daemon's
own ``WorkerMetrics`` registry in process. Standalone (``octo-worker
console``), it scrapes the daemon's ``[metrics] listen`` endpoint, or says
that no source is configured. Only metric labels and numbers pass through:
the labels are scopes, outcomes, reasons and error codes (never keys,
payloads or adapter text, see ``octo_worker.daemon.metrics``). This module never
changes a metric and never starts a scrape of anything but that endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import aiohttp
from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["LiveSnapshot", "LiveSource", "RegistrySource", "ScrapeSource", "UnavailableSource"]

_SCRAPE_TIMEOUT_SECONDS: Final = 2.0
_SCRAPE_LIMIT_BYTES: Final = 4 * 1024 * 1024
_TEXT_LIMIT: Final = 128  # a label value longer than this is cut


@dataclass
class LiveSnapshot:
    """One reading: counters per scope, and what the reading came from."""

    source: str
    available: bool
    taken_at: float = field(default_factory=time.time)
    deliveries: dict[str, dict[str, float]] = field(default_factory=dict)
    rejected: dict[str, dict[str, float]] = field(default_factory=dict)
    poisoned: dict[str, float] = field(default_factory=dict)
    oldest_pending_seconds: dict[str, float] = field(default_factory=dict)
    queues: dict[str, dict[str, float]] = field(default_factory=dict)
    consumers_active: float | None = None
    last_progress: float | None = None
    error: str | None = None

    def document(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "available": self.available,
            "taken_at": self.taken_at,
            "deliveries": self.deliveries,
            "rejected": self.rejected,
            "poisoned": self.poisoned,
            "oldest_pending_seconds": self.oldest_pending_seconds,
            "queues": self.queues,
            "consumers_active": self.consumers_active,
            "last_progress": self.last_progress,
            "error": self.error,
        }


class LiveSource(Protocol):
    description: str

    async def read(self) -> LiveSnapshot: ...


def _label(sample_labels: dict[str, str], name: str) -> str:
    value = str(sample_labels.get(name, "-"))
    return value if len(value) <= _TEXT_LIMIT else value[:_TEXT_LIMIT] + "..."


def _fold(families: Iterable[Metric], snapshot: LiveSnapshot) -> LiveSnapshot:
    for family in families:
        for sample in family.samples:
            labels = dict(sample.labels)
            value = float(sample.value)
            name = sample.name
            if name == "octo_deliveries_total":
                scope = snapshot.deliveries.setdefault(_label(labels, "scope"), {})
                scope[_label(labels, "outcome")] = value
            elif name == "octo_frames_rejected_total":
                scope = snapshot.rejected.setdefault(_label(labels, "scope"), {})
                scope[_label(labels, "reason")] = value
            elif name == "octo_sessions_poisoned_total":
                snapshot.poisoned[_label(labels, "scope")] = value
            elif name == "octo_oldest_unresolved_pending_seconds":
                snapshot.oldest_pending_seconds[_label(labels, "scope")] = value
            elif name in ("octo_queue_messages", "octo_queue_consumers"):
                queue = snapshot.queues.setdefault(_label(labels, "queue"), {})
                queue[name.removeprefix("octo_queue_")] = value
            elif name == "octo_consumers_active":
                snapshot.consumers_active = value
            elif name == "octo_last_progress_timestamp_seconds":
                snapshot.last_progress = value or None
    return snapshot


class RegistrySource:
    """The daemon's own registry, read in process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.description = "this daemon's metrics (in process)"

    async def read(self) -> LiveSnapshot:
        return _fold(self._registry.collect(), LiveSnapshot(self.description, True))


def scrape_url(listen: str) -> str:
    """``[metrics] listen`` as a URL this machine can reach (a wildcard becomes loopback)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):  # noqa: S104 (a wildcard bind is reached on loopback)
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}/metrics"


class ScrapeSource:
    """The daemon's ``[metrics] listen`` endpoint, scraped at each reading."""

    def __init__(self, listen: str) -> None:
        self.url = scrape_url(listen)
        self.description = f"the daemon's metrics endpoint {self.url}"
        self._session: aiohttp.ClientSession | None = None

    async def read(self) -> LiveSnapshot:
        snapshot = LiveSnapshot(self.description, False)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT_SECONDS)
            )
        try:
            async with self._session.get(self.url, allow_redirects=False) as response:
                if response.status != 200:
                    snapshot.error = f"the endpoint answered HTTP {response.status}"
                    return snapshot
                body = await response.content.read(_SCRAPE_LIMIT_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            snapshot.error = f"the endpoint is unreachable ({type(error).__name__})"
            return snapshot
        if len(body) > _SCRAPE_LIMIT_BYTES:
            snapshot.error = "the endpoint's answer is too large"
            return snapshot
        try:
            families = list(text_string_to_metric_families(body.decode("utf-8", "replace")))
        except ValueError:
            snapshot.error = "the endpoint's answer is not Prometheus text"
            return snapshot
        snapshot.available = True
        return _fold(families, snapshot)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            # aiohttp's connector closes its transports on the next loop turn.
            await asyncio.sleep(0)


class UnavailableSource:
    """No live source: the standalone console without a metrics endpoint."""

    def __init__(self, reason: str) -> None:
        self.description = reason

    async def read(self) -> LiveSnapshot:
        return LiveSnapshot(self.description, False, error=self.description)
