"""Prometheus metrics of the extender: requests and latencies per verb, decisions, cache sizes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


class _CacheCollector(Collector):
    def __init__(self, sizes: Callable[[], dict[str, float]]) -> None:
        self._sizes = sizes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sizes = self._sizes()
        for name, help_text in (
            ("assumed_pods", "Pods in the assume cache (bound or binding, not yet seen by the watch)"),
            ("pods", "Pods holding or about to hold GPUs, as the extender counts them"),
            ("unplaced_containers", "GPU containers on a node whose GPUs no annotation names yet"),
            ("nodes", "Nodes with GPUs known to the extender"),
            ("caches_synced", "1 when the node and pod watches have listed once"),
        ):
            yield GaugeMetricFamily(f"gpu_extender_{name}", help_text, value=sizes.get(name, 0.0))


class ExtenderMetrics:
    """The extender's collectors in their own registry."""

    def __init__(self, sizes: Callable[[], dict[str, float]]) -> None:
        # Process-wide, as the agent's page: counters start with the process, so no _created series.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gpu_extender_requests",
            "HTTP requests answered, by verb and status code",
            ["verb", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "gpu_extender_request_duration_seconds",
            "Time to answer a verb",
            ["verb"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "gpu_extender_decisions",
            "Outcomes: filter per node (pass, fail, unresolvable), bind per pod (bound, already_bound, refused, error)",
            ["verb", "outcome"],
            registry=self.registry,
        )
        self.conflicts = Counter(
            "gpu_extender_bind_conflicts", "Annotation patches answered 409 and retried", registry=self.registry
        )
        self.registry.register(_CacheCollector(sizes))
