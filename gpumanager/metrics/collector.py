"""Prometheus collector for the agent's own state: GPU health, advertised devices, kubelet registration."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpumanager import names
from gpumanager.device.health import HealthMonitor
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.topology import TopologyTree


class AgentView(Protocol):
    """What the collector reads from the agent."""

    gpus: list[GPUInfo]
    layout: DeviceLayout | None
    health: HealthMonitor | None
    plugins: PluginManager | None
    tree: TopologyTree | None

    def tree_snapshot(self) -> list[tuple[int, int, int, int, int]]:
        """(index, allocatable cores, allocatable bytes, total bytes, 1 if available for whole GPUs) per GPU."""


class AgentCollector(Collector):
    """Builds the agent's metrics at scrape time from the live objects (no copies to keep in sync)."""

    def __init__(self, agent: AgentView) -> None:
        self._agent = agent

    def describe(self) -> Sequence[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        health = agent.health.snapshot() if agent.health is not None else {}
        healthy = GaugeMetricFamily(
            "gpu_manager_gpu_healthy", "1 when the GPU is healthy, 0 when it is out of service", labels=["gpu", "uuid"]
        )
        for g in agent.gpus:
            state = health.get(g.index)
            healthy.add_metric([str(g.index), g.uuid], 1.0 if state is None or state.healthy else 0.0)
        yield healthy

        devices = GaugeMetricFamily(
            "gpu_manager_advertised_devices",
            "Fake devices advertised to the kubelet, by resource and health",
            labels=["resource", "health"],
        )
        if agent.layout is not None:
            for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
                total = agent.layout.count(resource)
                bad = sum(len(agent.layout.ids_of_gpu(resource, i)) for i, s in health.items() if not s.healthy)
                devices.add_metric([resource, names.HEALTHY], float(total - bad))
                devices.add_metric([resource, names.UNHEALTHY], float(bad))
        yield devices

        if agent.health is not None:
            xids = CounterMetricFamily(
                "gpu_manager_xid_events", "XID critical-error events received", labels=["ignored"]
            )
            xids.add_metric(["false"], float(agent.health.xid_events - agent.health.ignored_xid_events))
            xids.add_metric(["true"], float(agent.health.ignored_xid_events))
            yield xids

        if agent.tree is not None:
            cores = GaugeMetricFamily(
                "gpu_manager_gpu_cores", "vcuda-core units of a GPU, by state", labels=["gpu", "state"]
            )
            memory = GaugeMetricFamily(
                "gpu_manager_gpu_memory_bytes", "Memory of a GPU, by allocation state", labels=["gpu", "state"]
            )
            for index, free_cores, free_mem, total_mem, _ in agent.tree_snapshot():
                cores.add_metric([str(index), "allocatable"], float(free_cores))
                cores.add_metric([str(index), "allocated"], float(names.HUNDRED_CORES - free_cores))
                memory.add_metric([str(index), "allocatable"], float(free_mem))
                memory.add_metric([str(index), "allocated"], float(total_mem - free_mem))
            yield cores
            yield memory

        if agent.plugins is not None:
            status = agent.plugins.status
            yield GaugeMetricFamily(
                "gpu_manager_kubelet_registered",
                "1 while both resources are registered with the kubelet",
                value=1.0 if status.registered else 0.0,
            )
            yield CounterMetricFamily(
                "gpu_manager_kubelet_registrations",
                "Successful registrations with the kubelet",
                value=float(status.registrations),
            )
