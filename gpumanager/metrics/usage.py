"""Per-container GPU usage: NVML's processes on each GPU, attributed to containers by their cgroups.

For each GPU of a container: ``used_bytes`` is the sum of ``usedGpuMemory`` of the
GPU's compute processes that belong to the container, ``sm_ratio`` their SM
utilisation (per process the mean of NVML's samples over the last
``sample_period`` seconds, summed, 0-1), ``pids`` those PIDs. ``sm_samples_sum``
is gpu-manager's figure (every sample's ``smUtil`` added up) for its legacy metrics
and ``/usage``.

Which container a GPU process belongs to is read from the containers' cgroups
(``cgroup.procs``). Reading every container's cgroup on every scrape is the
expensive part, so the answer is kept: the cgroups are read again only when NVML
shows a PID that the last reading did not place (a new process), or when that
reading is older than ``rescan_period`` (which bounds how long a PID reused by
another container could be misattributed).
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

#: Longest time a container's PIDs are trusted without reading its cgroup again.
RESCAN_SECONDS = 60.0

Key = tuple[str, str]  # (pod UID, container)


@dataclass(frozen=True)
class DeviceUsage:
    """One GPU as seen by one container."""

    gpu: GPUInfo
    used_bytes: int
    sm_ratio: float  # 0-1: mean SM utilisation of each process over the window, summed
    sm_samples_sum: float  # gpu-manager's figure: smUtil percent of every sample, summed
    pids: tuple[int, ...]


@dataclass
class ContainerUsage:
    """A container's allocation, its pod, and what it uses on each of its GPUs."""

    pod: Pod
    allocation: ContainerAllocation
    devices: list[DeviceUsage] = field(default_factory=list)

    @property
    def container(self) -> str:
        """The container's name."""
        return self.allocation.container


@dataclass
class _GPUSample:
    procs: dict[int, int]  # pid -> used bytes
    sm_sum: dict[int, float]  # pid -> summed smUtil percent
    sm_count: dict[int, int]  # pid -> number of samples


_EMPTY = _GPUSample({}, {}, {})


def _sample_gpu(index: int, since_us: int) -> _GPUSample:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    procs = {int(p.pid): int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    sm_sum: dict[int, float] = {}
    sm_count: dict[int, int] = {}
    if procs:
        try:
            for s in pynvml.nvmlDeviceGetProcessUtilization(handle, since_us):
                pid = int(s.pid)
                sm_sum[pid] = sm_sum.get(pid, 0.0) + float(s.smUtil)
                sm_count[pid] = sm_count.get(pid, 0) + 1
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: no sample in the window
                log.debug("GPU %d process utilisation: %s", index, exc)
    return _GPUSample(procs, sm_sum, sm_count)


class UsageSampler:
    """Builds ContainerUsage for every allocated container of every known pod."""

    def __init__(
        self,
        *,
        gpus: Sequence[GPUInfo],
        allocations: Callable[[], list[ContainerAllocation]],
        pod: Callable[[str], Pod | None],
        cgroup_root: Path,
        sample_period: float,
        rescan_period: float = RESCAN_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._gpus = {g.minor: g for g in gpus}
        self._allocations = allocations
        self._pod = pod
        self._cgroups = cgroups.CgroupLocator(cgroup_root)
        self._period = sample_period
        self._rescan_period = rescan_period
        self._clock = clock
        self._owner: dict[int, Key] = {}  # pid -> container, from the last cgroup reading
        self._placed: set[int] = set()  # every PID the last reading saw (in a container or not)
        self._containers: dict[Key, tuple[str, str | None]] = {}  # containers of the last reading
        self._parsed: dict[str, tuple[Pod, dict[str, str], str | None]] = {}  # pod UID -> (pod, IDs, QoS)
        self._scanned_at: float | None = None
        #: How many times the containers' cgroups were read (for tests and benchmarks).
        self.scans = 0

    def sample(self) -> list[ContainerUsage]:
        """One pass over all containers (NVML is asked once per GPU)."""
        since_us = int((time.time() - self._period) * 1_000_000)
        usages: list[ContainerUsage] = []
        for alloc in self._allocations():
            pod = self._pod(alloc.pod_uid)
            if pod is not None:
                usages.append(ContainerUsage(pod, alloc))
        per_gpu: dict[int, _GPUSample] = {}
        for u in usages:
            for minor in u.allocation.minors:
                gpu = self._gpus.get(minor)
                if gpu is None or gpu.index in per_gpu:
                    continue
                try:
                    per_gpu[gpu.index] = _sample_gpu(gpu.index, since_us)
                except pynvml.NVMLError as exc:
                    log.debug("GPU %d usage unavailable: %s", gpu.index, exc)
                    per_gpu[gpu.index] = _EMPTY
        gpu_pids = {pid for s in per_gpu.values() for pid in s.procs}
        self._place(gpu_pids, usages)
        # (GPU index, container) -> its PIDs on that GPU, in one pass over NVML's processes.
        mine: dict[tuple[int, Key], list[int]] = {}
        for index, s in per_gpu.items():
            for pid in s.procs:
                owner = self._owner.get(pid)
                if owner is not None:
                    mine.setdefault((index, owner), []).append(pid)
        for u in usages:
            key = u.allocation.key
            for minor in u.allocation.minors:
                gpu = self._gpus.get(minor)
                if gpu is None:
                    continue
                s = per_gpu.get(gpu.index, _EMPTY)
                pids = sorted(mine.get((gpu.index, key), ()))
                u.devices.append(
                    DeviceUsage(
                        gpu=gpu,
                        used_bytes=sum(s.procs[p] for p in pids),
                        sm_ratio=min(1.0, sum(s.sm_sum[p] / s.sm_count[p] for p in pids if p in s.sm_count) / 100),
                        sm_samples_sum=sum(s.sm_sum.get(p, 0.0) for p in pids),
                        pids=tuple(pids),
                    )
                )
        return usages

    def _place(self, gpu_pids: set[int], usages: Sequence[ContainerUsage]) -> None:
        """Read the containers' cgroups again when a GPU PID or a container is new, or the reading is old."""
        containers: dict[Key, tuple[str, str | None]] = {}
        parsed: dict[str, tuple[Pod, dict[str, str], str | None]] = {}
        for u in usages:
            uid = u.allocation.pod_uid
            entry = parsed.get(uid) or self._parsed.get(uid)
            if entry is None or entry[0] is not u.pod:  # the pod cache holds a new object after every change
                entry = (u.pod, podinfo.container_ids(u.pod), (u.pod.get("status") or {}).get("qosClass"))
            parsed[uid] = entry
            cid = entry[1].get(u.container)
            if cid:
                containers[u.allocation.key] = (cid, entry[2])
        self._parsed = parsed
        now = self._clock()
        fresh = self._scanned_at is not None and now - self._scanned_at < self._rescan_period
        if fresh and gpu_pids <= self._placed and containers == self._containers:
            return
        owner: dict[int, Key] = {}
        for key, (cid, qos) in containers.items():
            for pid in self._cgroups.pids(key[0], cid, qos):
                owner[pid] = key
        self._owner = owner
        self._placed = set(owner) | gpu_pids
        self._containers = containers
        self._scanned_at = now
        self.scans += 1
