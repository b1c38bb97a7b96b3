"""The agent's query side: the display socket (gRPC) and the HTTP port, with what they read.

``/graph``, ``/usage`` and ``/version`` (as gpu-manager's gateway), ``/metrics``, ``/healthz``
and ``/readyz`` on HTTP; PrintGraph, PrintUsages and Version on the display socket. Either
failing to listen is reported and leaves the other (and the device plugin) serving.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from gpumanager import buildinfo
from gpumanager.allocation.allocator import Allocator
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import display_pb2
from gpumanager.metrics.calls import CallMetrics, CheckpointWriteMetrics
from gpumanager.metrics.collector import AgentView
from gpumanager.metrics.display import DisplayServer, DisplayServicer
from gpumanager.metrics.endpoints import DisplayData, ProbedAgent, agent_probes
from gpumanager.metrics.http import QueryServer
from gpumanager.metrics.page import MetricsPage
from gpumanager.metrics.usage import UsageSampler


def display_version() -> str:
    """What Version and ``/version`` answer: the short git commit, as gpu-manager's (built with
    ``-X …/pkg/version.gitCommit=<short sha>``); the package version when the build recorded no commit."""
    commit = buildinfo.commit()
    return commit[:7] if commit != buildinfo.UNKNOWN else buildinfo.version()


class QueriedAgent(ProbedAgent, AgentView, Protocol):
    """What the query side reads from the agent: the probes' and the metrics collector's view."""


class QueryEndpoints:
    """The display server and the HTTP server of one agent, and the metrics registry they share."""

    def __init__(
        self,
        agent: QueriedAgent,
        allocator: Allocator,
        report: Callable[[str, str], None],
    ) -> None:
        cfg = agent.config
        self._agent = agent
        self._report = report
        self.sampler = UsageSampler(
            gpus=agent.gpus,
            allocations=self._allocations,
            pod=agent.pods.get,
            cgroup_root=Path(cfg.cgroup_root),
            sample_period=float(cfg.sample_period),
            version=self._state_version,
            synced=agent.pods.synced,
        )
        self._data = DisplayData(agent.gpus, allocator.graph, self.sampler.sample)
        self.probes = agent_probes(agent)
        self.registry = CollectorRegistry()
        self.calls = CallMetrics(self.registry, mode=cfg.mode, driver=cfg.dra_driver_name)
        self.checkpoint_writes = CheckpointWriteMetrics(self.registry)
        allocator.observe_checkpoint_writes(self.checkpoint_writes.observe)
        self.display: DisplayServer | None = None
        self.http: QueryServer | None = None

    def start(self) -> None:
        """Listen on the display socket, then on the HTTP port; a failure of either is reported."""
        cfg, data, sampler = self._agent.config, self._data, self.sampler
        version = display_version()
        servicer = DisplayServicer(graph=data.graph_text, usages=data.usages, version=version)
        display = DisplayServer(servicer, Path(cfg.display_socket))
        try:
            display.start()
            self.display = display
        except (OSError, RuntimeError) as exc:
            self._report("display", f"cannot serve --display-socket={cfg.display_socket}: {exc}")
        page = MetricsPage(
            agent=self._agent,
            registry=self.registry,
            sample=sampler.sample,
            legacy_metrics=cfg.legacy_metrics,
            node=cfg.resolved_node_name(),
        )
        routes: dict[str, Callable[[], Any]] = {
            "/graph": lambda: display_pb2.GraphResponse(graph=data.graph_text()),
            "/usage": data.usages,
            "/version": lambda: display_pb2.VersionResponse(version=version),
        }
        try:
            http = QueryServer(
                cfg.query_addr,
                cfg.query_port,
                routes=routes,
                metrics=page.render,
                health=self.probes.healthz,
                ready=self.probes.readyz,
            )
            http.start()
            self.http = http
        except OSError as exc:
            self._report(
                "http",
                f"cannot listen on --query-addr={cfg.query_addr} --query-port={cfg.query_port}: "
                f"{exc.strerror or exc}; /metrics, /healthz and /readyz are not served until the agent is "
                "restarted with the port free (or another --query-port)",
            )

    def _allocations(self) -> list[ContainerAllocation]:
        """Every container's allocation: the device plugin's, then DRA claims' containers."""
        agent = self._agent
        mine = agent.allocator.allocations() if agent.allocator is not None else []
        return mine + agent.dra.container_allocations() if agent.dra is not None else mine

    def _state_version(self) -> tuple[int, int, int, int]:
        """Changes whenever :meth:`_allocations` or a pod lookup could answer differently: the allocator's
        generation (allocations, claims), the pod cache's (changes(-1) only reads it), which parts exist
        and what DRA mode knows of the pods each claim is reserved for (-1: no DRA mode)."""
        agent = self._agent
        allocator = agent.allocator
        return (
            id(allocator),
            allocator.generation if allocator is not None else -1,
            agent.pods.changes(-1)[0],
            agent.dra.reservations.generation if agent.dra is not None else -1,
        )

    def stop(self) -> None:
        """Stop both servers."""
        if self.display is not None:
            self.display.stop()
        if self.http is not None:
            self.http.stop()
