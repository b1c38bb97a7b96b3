"""Per-container GPU usage: the container's host PIDs (from its cgroup) matched against NVML's view.

For each device of a container (as gpu-manager computes it): ``mem`` is the sum
of ``usedGpuMemory`` of the GPU's compute processes that belong to the container
(MiB), ``gpu`` the sum of their SM utilisation samples over the last
``sample_period`` seconds, ``pids`` those PIDs, ``device_mem`` the GPU's memory
(MiB).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pynvml

from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device.types import GPUInfo
from gpumanager.vmanager import cgroups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceUsage:
    """One GPU as seen by one container."""

    index: int
    bus_id: str
    gpu: float  # SM utilisation, percent
    mem: float  # MiB used by the container's processes
    pids: tuple[int, ...]
    device_mem: float  # MiB


@dataclass
class ContainerUsage:
    """A container's request and what it uses."""

    pod: Pod
    container: str
    cores: int
    memory_blocks: int
    devices: list[DeviceUsage] = field(default_factory=list)


@dataclass
class _GPUSample:
    procs: dict[int, int]  # pid -> used bytes
    sm: dict[int, float]  # pid -> summed smUtil


def _sample_gpu(index: int, since_us: int) -> _GPUSample:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    procs = {int(p.pid): int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    sm: dict[int, float] = {}
    try:
        for s in pynvml.nvmlDeviceGetProcessUtilization(handle, since_us):
            sm[int(s.pid)] = sm.get(int(s.pid), 0.0) + float(s.smUtil)
    except pynvml.NVMLError as exc:
        if exc.value != pynvml.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: no sample in the window
            log.debug("GPU %d process utilisation: %s", index, exc)
    return _GPUSample(procs, sm)


class UsageSampler:
    """Builds ContainerUsage for every allocated container of every active pod."""

    def __init__(
        self,
        *,
        gpus: Sequence[GPUInfo],
        allocations: Callable[[], list[ContainerAllocation]],
        pod: Callable[[str], Pod | None],
        cgroup_root: Path,
        sample_period: float,
    ) -> None:
        self._gpus = {g.minor: g for g in gpus}
        self._allocations = allocations
        self._pod = pod
        self._cgroups = cgroups.CgroupLocator(cgroup_root)
        self._period = sample_period

    def sample(self) -> list[ContainerUsage]:
        """One pass over all containers (NVML is asked once per GPU)."""
        since_us = int((time.time() - self._period) * 1_000_000)
        per_gpu: dict[int, _GPUSample] = {}
        out = []
        for alloc in self._allocations():
            pod = self._pod(alloc.pod_uid)
            if pod is None:
                continue
            usage = ContainerUsage(pod, alloc.container, alloc.cores, alloc.memory >> 28)
            cid = podinfo.container_ids(pod).get(alloc.container)
            qos = (pod.get("status") or {}).get("qosClass")
            pids = set(self._cgroups.pids(alloc.pod_uid, cid, qos)) if cid else set()
            for minor in alloc.minors:
                gpu = self._gpus.get(minor)
                if gpu is None:
                    continue
                if gpu.index not in per_gpu:
                    try:
                        per_gpu[gpu.index] = _sample_gpu(gpu.index, since_us)
                    except pynvml.NVMLError as exc:
                        log.debug("GPU %d usage unavailable: %s", gpu.index, exc)
                        per_gpu[gpu.index] = _GPUSample({}, {})
                s = per_gpu[gpu.index]
                mine = sorted(pids & set(s.procs))
                usage.devices.append(
                    DeviceUsage(
                        index=gpu.index,
                        bus_id=gpu.pci_bus_id,
                        gpu=sum(v for p, v in s.sm.items() if p in pids),
                        mem=sum(s.procs[p] for p in mine) / (1 << 20),
                        pids=tuple(mine),
                        device_mem=gpu.memory_total / (1 << 20),
                    )
                )
            out.append(usage)
        return out
