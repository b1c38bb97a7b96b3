"""The ``/metrics`` page: the agent's families, the process metrics, the per-container families.

One usage sample per scrape feeds the per-container families (and upstream's legacy
families with ``--legacy-metrics``). The page carries no ``_created`` series: counters
and histograms start at the agent's start, which ``process_start_time_seconds`` says.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, ProcessCollector

from gpumanager.metrics import legacy, textformat
from gpumanager.metrics.collector import AgentCollector, AgentView
from gpumanager.metrics.containers import ContainerFamilies
from gpumanager.metrics.usage import ContainerUsage

#: The format the page is written in, whatever the installed client's latest is (0.26 says 1.0.0).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsPage:
    """Renders the whole page in the text format (0.0.4)."""

    def __init__(
        self,
        *,
        agent: AgentView,
        registry: CollectorRegistry,
        sample: Callable[[], list[ContainerUsage]],
        legacy_metrics: bool,
        node: str = "",
    ) -> None:
        """``node``: the agent's node, the legacy families' ``node`` of a pod known only from its allocations."""
        # Process-wide: this agent exports no _created series (counters start with the process).
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        registry.register(AgentCollector(agent))
        ProcessCollector(registry=registry)
        self._registry = registry
        self._sample = sample
        self._legacy = legacy_metrics
        self._node = node
        self._containers = ContainerFamilies()
        self._families = textformat.FamilyText()
        # Upstream's families of the last sample: written again only for a sample that differs (the
        # sampler keeps a container's usage object while nothing of it changes).
        self._legacy_last: tuple[tuple[ContainerUsage, ...], bytes] = ((), b"")

    def render(self) -> bytes:
        """The page body."""
        usages = self._sample()
        text = self._families.render(self._registry.collect()) + self._containers.render(usages)
        body = text.encode()
        if self._legacy:
            last, page = self._legacy_last
            if not page or len(last) != len(usages) or not all(map(operator.is_, last, usages)):
                page = legacy.render(usages, self._node).encode()
                self._legacy_last = (tuple(usages), page)
            body += page
        return body
