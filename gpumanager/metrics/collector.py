"""Prometheus collector for the agent's own state: build, GPUs, kubelet registration, XIDs, checkpoint.

Every per-GPU family carries ``gpu`` (the NVML index, as in every family of the
agent) and ``uuid``; sums over GPUs are left to PromQL. Counters have a series for
every label value from the start, so ``rate()`` and ``increase()`` see their first
increment.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import pynvml
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpumanager import buildinfo, names
from gpumanager.allocation.allocator import Allocator
from gpumanager.device import nvml
from gpumanager.device.health import HealthMonitor
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.metrics.bounded import NVML, NVMLReads

GPU_LABELS = ["gpu", "uuid"]


class AgentView(Protocol):
    """What the collector reads from the agent."""

    gpus: list[GPUInfo]
    layout: DeviceLayout | None
    health: HealthMonitor | None
    plugins: PluginManager | None
    allocator: Allocator | None


def _read_usage(index: int) -> tuple[int, float] | None:
    """(memory used in bytes, utilisation percent) of GPU ``index``; None when NVML cannot read it."""
    try:
        handle = nvml.handle(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
    except pynvml.NVMLError:
        return None
    return int(memory.used), float(rates.gpu)


def _gauge(name: str, help_text: str, labels: Sequence[str] = GPU_LABELS) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, labels=list(labels))


class AgentCollector(Collector):
    """Builds the agent's metrics at scrape time from the live objects (no copies to keep in sync)."""

    def __init__(self, agent: AgentView, nvml: NVMLReads = NVML) -> None:
        self._agent = agent
        self._nvml = nvml

    def describe(self) -> Sequence[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        build = _gauge(
            "gpu_manager_build_info", "Version and git commit of the running agent (always 1)", ["version", "commit"]
        )
        build.add_metric([buildinfo.version(), buildinfo.commit()], 1.0)
        yield build
        yield from self._gpus()
        yield from self._devices()
        yield from self._kubelet()
        yield from self._xids()
        yield from self._checkpoint()

    def _gpus(self) -> Iterator[Metric]:
        agent = self._agent
        health = agent.health.snapshot() if agent.health is not None else {}
        info = _gauge("gpu_manager_gpu_info", "A GPU of the node (always 1)", [*GPU_LABELS, "model", "pci_bus_id"])
        healthy = _gauge("gpu_manager_gpu_healthy", "1 when the GPU is healthy, 0 while it is out of service")
        capacity = _gauge("gpu_manager_gpu_memory_bytes", "Memory of the GPU")
        used = _gauge("gpu_manager_gpu_memory_used_bytes", "Memory in use on the GPU, as NVML reports it")
        util = _gauge("gpu_manager_gpu_utilization_ratio", "Utilisation of the GPU, as NVML reports it (0-1)")
        allocated_mem = _gauge("gpu_manager_gpu_memory_allocated_bytes", "Memory of the GPU allocated to containers")
        allocated_cores = _gauge(
            "gpu_manager_gpu_core_allocated_ratio", "Share of the GPU's compute allocated to containers (0-1)"
        )
        gpus = list(agent.gpus)
        # A GPU NVML does not answer for has no usage figures (as a lost GPU has none).
        readings = self._nvml.per_gpu([g.index for g in gpus], _read_usage)
        for g in gpus:
            key = [str(g.index), g.uuid]
            info.add_metric([*key, g.name, g.pci_bus_id], 1.0)
            state = health.get(g.index)
            healthy.add_metric(key, 1.0 if state is None or state.healthy else 0.0)
            capacity.add_metric(key, float(g.memory_total))
            reading = readings.get(g.index)
            if reading is None:
                continue  # a lost GPU has no usage; gpu_manager_gpu_healthy says why
            used.add_metric(key, float(reading[0]))
            util.add_metric(key, reading[1] / 100)
        by_index = {g.index: g for g in agent.gpus}
        if agent.allocator is not None:
            beyond = agent.allocator.charged_beyond_capacity()  # the tree's figures stop at the capacity
            for index, free_cores, free_mem, total_mem, _ in agent.allocator.tree_snapshot():
                gpu = by_index.get(index)
                if gpu is None:
                    continue
                key = [str(index), gpu.uuid]
                cores, memory = beyond.get(index, (names.HUNDRED_CORES - free_cores, total_mem - free_mem))
                allocated_cores.add_metric(key, cores / names.HUNDRED_CORES)
                allocated_mem.add_metric(key, float(memory))
        yield from (info, healthy, capacity, used, util, allocated_mem, allocated_cores)

    def _devices(self) -> Iterator[Metric]:
        agent = self._agent
        devices = _gauge(
            "gpu_manager_advertised_devices",
            "Devices advertised to the kubelet (DRA mode: in the driver's ResourceSlice), by resource and health",
            ["resource", "health"],
        )
        config = getattr(agent, "config", None)
        if getattr(config, "mode", "") == "dra":
            # The DRA driver offers one device per GPU in its ResourceSlice, no vcuda-* devices.
            health = agent.health.snapshot() if agent.health is not None else {}
            driver = str(getattr(config, "dra_driver_name", ""))
            bad = sum(1 for g in agent.gpus if (state := health.get(g.index)) is not None and not state.healthy)
            devices.add_metric([driver, names.HEALTHY], float(len(agent.gpus) - bad))
            devices.add_metric([driver, names.UNHEALTHY], float(bad))
        elif agent.layout is not None:
            health = agent.health.snapshot() if agent.health is not None else {}
            for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
                total = agent.layout.count(resource)
                bad = sum(len(agent.layout.ids_of_gpu(resource, i)) for i, s in health.items() if not s.healthy)
                devices.add_metric([resource, names.HEALTHY], float(total - bad))
                devices.add_metric([resource, names.UNHEALTHY], float(bad))
        yield devices

    def _kubelet(self) -> Iterator[Metric]:
        agent = self._agent
        registered, registrations = False, 0
        if agent.plugins is not None:
            registered, registrations = agent.plugins.status.registered, agent.plugins.status.registrations
        else:
            # DRA mode registers the DRA driver instead of the two resources.
            dra = getattr(agent, "dra", None)
            if dra is not None:
                state = dra.sockets.state
                registered, registrations = state.registered and not state.last_error, state.registrations
        yield GaugeMetricFamily(
            "gpu_manager_kubelet_registered",
            "1 while both resources (in DRA mode: the DRA driver) are registered with the kubelet",
            value=1.0 if registered else 0.0,
        )
        yield CounterMetricFamily(
            "gpu_manager_kubelet_registrations",
            "Successful registrations of both resources (in DRA mode: the DRA driver) with the kubelet",
            value=float(registrations),
        )

    def _xids(self) -> Iterator[Metric]:
        health = self._agent.health
        xids = CounterMetricFamily(
            "gpu_manager_xid_events",
            "XID critical-error events received; ignored=true for the XIDs of --ignored-xids",
            labels=["ignored"],
        )
        # Each count read on its own (a difference of two counts read apart could drop while events arrive).
        xids.add_metric(["false"], float(health.critical_xid_events if health is not None else 0))
        xids.add_metric(["true"], float(health.ignored_xid_events if health is not None else 0))
        yield xids

    def _checkpoint(self) -> Iterator[Metric]:
        allocator = self._agent.allocator
        yield CounterMetricFamily(
            "gpu_manager_checkpoint_writes",
            "Writes of the allocation checkpoint",
            value=float(allocator.checkpoint_writes if allocator is not None else 0),
        )
        yield CounterMetricFamily(
            "gpu_manager_checkpoint_write_failures",
            "Writes of the allocation checkpoint that failed (the allocation was refused)",
            value=float(allocator.checkpoint_write_failures if allocator is not None else 0),
        )
