"""Per-container GPU usage: NVML's processes on each GPU, attributed to containers by their cgroups.

For each GPU of a container: ``used_bytes`` is the sum of ``usedGpuMemory`` of the
GPU's compute processes that belong to the container, ``sm_ratio`` their SM
utilisation (per process the mean of NVML's samples over the last
``sample_period`` seconds, summed, 0-1), ``pids`` those PIDs. ``sm_samples_sum``
is gpu-manager's figure (every sample's ``smUtil`` added up) for its legacy metrics
and ``/usage``.

Which container a GPU process belongs to is read from the containers' cgroups
(``cgroup.procs``), as little as possible (:mod:`gpumanager.metrics.attribution`):
a new container, a PID new on a GPU, and placements older than ``rescan_period``
(which bounds how long a PID reused by another container could be misattributed). A container
that restarted, whose pod's status still names the old container ID (its cgroup gone) for a second
or two, is read in its new cgroup, told apart as the pids.config refresh tells it
(:mod:`gpumanager.vmanager.restarts`), so that its new processes' usage is its own meanwhile.

NVML is asked on every sample (memory and utilisation are never older than the
scrape), for at most :data:`gpumanager.metrics.bounded.DEADLINE` seconds: while it does
not answer for a GPU, the containers' usage of that GPU is unknown (left out, as on a lost GPU). What the
allocation state and the pod cache say (which containers, their pods, GPUs and container
IDs) is looked up again only when their generations moved.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pynvml

from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device import nvml
from gpumanager.device.types import GPUInfo
from gpumanager.metrics.attribution import Key, ProcessOwners
from gpumanager.metrics.bounded import NVML, NVMLReads
from gpumanager.vmanager import cgroups, restarts

log = logging.getLogger(__name__)

#: Longest time a container's PIDs are trusted without reading its cgroup again.
RESCAN_SECONDS = 60.0


@dataclass(frozen=True)
class DeviceUsage:
    """One GPU as seen by one container."""

    gpu: GPUInfo
    used_bytes: int
    sm_ratio: float  # 0-1: mean SM utilisation of each process over the window, summed
    sm_samples_sum: float  # gpu-manager's figure: smUtil percent of every sample, summed
    pids: tuple[int, ...]
    #: False while NVML cannot read the GPU (lost): its usage is unknown, not 0, and is left out.
    measured: bool = True


@dataclass(frozen=True)
class ContainerUsage:
    """A container's allocation, its pod, and what it uses on each of its GPUs.

    The sampler hands out the same object again while none of the three changed: readers
    must not change it, and may keep what they derive from it while it is the one they get.
    """

    pod: Pod
    allocation: ContainerAllocation
    devices: Sequence[DeviceUsage] = ()

    @property
    def container(self) -> str:
        """The container's name."""
        return self.allocation.container


@dataclass(frozen=True)
class _Held:
    """An allocated container whose pod is known, and the GPUs it holds."""

    pod: Pod
    allocation: ContainerAllocation
    gpus: tuple[GPUInfo, ...]
    idle: tuple[DeviceUsage, ...]  # its usage while no process of it is on a GPU
    key: Key  # (pod UID, container)


@dataclass(frozen=True)
class _Plan:
    """What a sample reads from the allocation state and the pod cache, kept while both are unchanged."""

    version: Hashable
    held: tuple[_Held, ...]
    indexes: tuple[int, ...]  # the GPUs to ask NVML about: those of some container
    containers: dict[Key, tuple[str, str | None]]  # (container ID, QoS class) of each running container
    holders: dict[int, list[Key]]  # GPU index -> the containers holding it
    pods: dict[str, Pod]  # pod UID -> the pod its containers' IDs were read from


@dataclass
class _GPUSample:
    procs: dict[int, int]  # pid -> used bytes
    sm_sum: dict[int, float]  # pid -> summed smUtil percent
    sm_count: dict[int, float]  # pid -> what its sum is divided by: its samples, or the periods in the window


_EMPTY = _GPUSample({}, {}, {})
_UNREAD = _GPUSample({}, {}, {})  # a GPU NVML could not be asked about (lost)


def _sample_gpu(index: int, since_us: int, *, now_us: int | None = None) -> _GPUSample:
    handle = nvml.handle(index)
    procs = {int(p.pid): int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    sm_sum: dict[int, float] = {}
    sm_count: dict[int, float] = {}
    if procs:
        try:
            samples = [(int(s.pid), int(s.timeStamp), float(s.smUtil))
                       for s in pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)]  # fmt: skip
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: no sample in the window
                log.debug("GPU %d process utilisation: %s", index, exc)
            samples = []
        periods = _periods_in_window(samples, since_us, int(time.time() * 1e6) if now_us is None else now_us)
        for pid, _ts, sm in samples:
            sm_sum[pid] = sm_sum.get(pid, 0.0) + sm
            sm_count[pid] = periods if periods else sm_count.get(pid, 0.0) + 1
    return _GPUSample(procs, sm_sum, sm_count)


def _periods_in_window(samples: Sequence[tuple[int, int, float]], since_us: int, now_us: int) -> float:
    """How many sampling periods the window holds where the driver samples the whole GPU (0: it samples each
    process).  Such a driver (an H200's, 580.159) names one process per period with the GPU's busy percent, and
    keeps every period, so a busy process appears at several times: its samples are divided by the window's
    periods, not by their own count (named once in five periods it read 99 %, not 20 %).  Sampled per process, each
    process has one sample, its average over the window."""
    times: dict[int, set[int]] = {}
    for pid, ts, _sm in samples:
        times.setdefault(pid, set()).add(ts)
    if all(len(stamps) < 2 for stamps in times.values()):
        return 0.0
    stamps = sorted({ts for _pid, ts, _sm in samples})
    period = min(b - a for a, b in itertools.pairwise(stamps))
    return max(1.0, (now_us - since_us) / period) if period > 0 else 0.0


class UsageSampler:
    """Builds ContainerUsage for every allocated container of every known pod.

    ``version`` returns a value that changes whenever ``allocations`` or ``pod`` could answer
    differently (the allocator's and the pod cache's generations): while it stays the same, the
    containers, their pods and their GPUs are not looked up again, and a container whose usage
    did not change is handed out as the same ContainerUsage object. Without it every sample
    looks everything up. NVML is asked on every sample.
    """

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
        version: Callable[[], Hashable] | None = None,
        nvml: NVMLReads = NVML,
        synced: Callable[[], bool] | None = None,
    ) -> None:
        self._gpus = gpus
        self._nvml = nvml  # the agent's list: a GPU that comes back may be described anew
        self._allocations = allocations
        self._pod = pod
        self._version = version
        #: Whether the pod cache has a complete view; until it has, a container whose pod it lacks is
        #: listed under the namespace and name its allocation recorded (its usage unknown).
        self._synced = synced
        self._standins: dict[str, Pod] = {}  # pod UID -> the stand-in pod made from its allocation
        self._period = sample_period
        self._locator = cgroups.CgroupLocator(cgroup_root)
        self._owners = ProcessOwners(self._locator, rescan_period=rescan_period, clock=clock, read=self._pids_of)
        self._plan: _Plan | None = None
        self._last: dict[Key, ContainerUsage] = {}  # the last sample's usages
        self._zero: dict[int, DeviceUsage] = {}  # by GPU index: no process of the container there
        self._unknown: dict[int, DeviceUsage] = {}  # by GPU index: NVML cannot read the GPU
        self._lock = threading.Lock()  # one sample at a time (the HTTP server serves each scrape in a thread)
        #: How many times the containers were looked up in the allocation state and the pod cache.
        self.plans = 0

    @property
    def scans(self) -> int:
        """Samples that read some container's cgroup (for tests and benchmarks)."""
        return self._owners.scans

    @property
    def cgroup_reads(self) -> int:
        """Containers' cgroups read in all (for tests and benchmarks)."""
        return self._owners.reads

    def sample(self) -> list[ContainerUsage]:
        """One pass over all containers (NVML is asked once per GPU)."""
        with self._lock:
            return self._sample()

    def _sample(self) -> list[ContainerUsage]:
        since_us = int((time.time() - self._period) * 1_000_000)
        plan = self._current_plan()
        per_gpu = self._read_gpus(plan.indexes, since_us) if plan.indexes else {}
        unread = {index for index, s in per_gpu.items() if s is _UNREAD}
        self._owners.update(plan.containers, plan.holders, {index: s.procs for index, s in per_gpu.items()})
        # (GPU index, container) -> its PIDs on that GPU, in one pass over NVML's processes.
        mine: dict[tuple[int, Key], list[int]] = {}
        busy: set[Key] = set()  # containers with a process on a GPU
        owner_of = self._owners.owner
        for index, s in per_gpu.items():
            for pid in s.procs:
                owner = owner_of(pid)
                if owner is not None:
                    mine.setdefault((index, owner), []).append(pid)
                    busy.add(owner)
        last = self._last
        usages: list[ContainerUsage] = []
        new = False
        for held in plan.held:
            key = held.key
            if key in busy or (unread and any(gpu.index in unread for gpu in held.gpus)):
                devices = tuple(
                    self._unmeasured(gpu)
                    if gpu.index in unread
                    else self._device(gpu, per_gpu.get(gpu.index, _EMPTY), mine.get((gpu.index, key)))
                    for gpu in held.gpus
                )
            else:
                devices = held.idle
            before = last.get(key)
            if (
                before is not None
                and before.allocation is held.allocation
                and before.pod is held.pod
                and (before.devices is devices or before.devices == devices)
            ):
                usages.append(before)
            else:
                usages.append(ContainerUsage(held.pod, held.allocation, devices))
                new = True
        if new or len(last) != len(usages):
            self._last = {u.allocation.key: u for u in usages}
        return usages

    def _pids_of(self, key: Key, container: tuple[str, str | None]) -> list[int]:
        """The PIDs of the container of ``key`` (pod UID, container), running as ``container`` (the ID its
        pod's status names, its QoS class): its cgroup's, or, when that one is gone (it restarted and the
        status does not name the new ID yet), its new cgroup's, when that can be told (as the pids.config
        refresh finds it)."""
        plan = self._plan
        pod = plan.pods.get(key[0]) if plan is not None else None
        if pod is None or podinfo.container_ids(pod).get(key[1]) != container[0]:
            return self._locator.pids(key[0], container[0], container[1])
        return restarts.container_pids(self._locator, pod, key[1])

    def _read_gpus(self, indexes: Sequence[int], since_us: int) -> dict[int, _GPUSample]:
        """NVML's processes on each GPU; a GPU it cannot read (or does not answer for) unread."""

        def read(index: int) -> _GPUSample:
            try:
                return _sample_gpu(index, since_us)
            except pynvml.NVMLError as exc:
                log.debug("GPU %d usage unavailable: %s", index, exc)
                return _UNREAD

        read_now = self._nvml.per_gpu(indexes, read)
        return {index: read_now.get(index, _UNREAD) for index in indexes}

    def _idle(self, gpu: GPUInfo) -> DeviceUsage:
        zero = self._zero.get(gpu.index)
        if zero is None or zero.gpu is not gpu:
            zero = self._zero[gpu.index] = DeviceUsage(gpu, 0, 0.0, 0.0, ())
        return zero

    def _unmeasured(self, gpu: GPUInfo) -> DeviceUsage:
        unknown = self._unknown.get(gpu.index)
        if unknown is None or unknown.gpu is not gpu:
            unknown = self._unknown[gpu.index] = DeviceUsage(gpu, 0, 0.0, 0.0, (), measured=False)
        return unknown

    def _device(self, gpu: GPUInfo, s: _GPUSample, pids: list[int] | None) -> DeviceUsage:
        if not pids:
            return self._idle(gpu)
        pids.sort()
        return DeviceUsage(
            gpu=gpu,
            used_bytes=sum(s.procs[p] for p in pids),
            sm_ratio=min(1.0, sum(s.sm_sum[p] / s.sm_count[p] for p in pids if p in s.sm_count) / 100),
            sm_samples_sum=sum(s.sm_sum.get(p, 0.0) for p in pids),
            pids=tuple(pids),
        )

    def _current_plan(self) -> _Plan:
        """The containers to sample: the last ones while the version is the same, else looked up again."""
        version = self._version() if self._version is not None else None
        synced = self._synced() if self._synced is not None else True
        if version is not None:
            version = (version, synced)
        plan = self._plan
        if plan is not None and version is not None and plan.version == version:
            return plan
        # The version is read before what it stands for: a change meanwhile shows in the next one.
        by_minor = {g.minor: g for g in self._gpus}
        before = {h.allocation.key: h for h in plan.held} if plan is not None else {}
        held: list[_Held] = []
        containers: dict[Key, tuple[str, str | None]] = {}
        ids: dict[str, tuple[dict[str, str], str | None]] = {}  # pod UID -> (container IDs, QoS class)
        found: list[tuple[ContainerAllocation, Pod]] = []
        standins: dict[str, Pod] = {}
        for alloc in self._allocations():
            pod = self._pod(alloc.pod_uid)
            if pod is None and not synced and alloc.namespace and alloc.pod_name:
                # No complete pod list yet (an agent started while the API server cannot be reached):
                # the container still runs and holds its GPUs. A stand-in keeps its series, with the
                # names its allocation recorded; its usage is unknown (its container ID is in the pod).
                pod = self._standins.get(alloc.pod_uid) or _standin(alloc)
                standins[alloc.pod_uid] = pod
            if pod is not None:
                found.append((alloc, pod))
        self._standins = standins
        for alloc, pod in _reported(found):
            gpus = tuple(by_minor[m] for m in alloc.minors if m in by_minor)
            old = before.get(alloc.key)
            if old is not None and old.pod is pod and old.allocation == alloc and old.gpus == gpus:
                held.append(old)  # the same objects: what readers derived from them stays valid
            else:
                measure = self._unmeasured if alloc.pod_uid in standins else self._idle
                held.append(_Held(pod, alloc, gpus, tuple(measure(g) for g in gpus), alloc.key))
            entry = ids.get(alloc.pod_uid)
            if entry is None:
                entry = ids[alloc.pod_uid] = (podinfo.container_ids(pod), podinfo.qos_class(pod))
            cid = entry[0].get(alloc.container)
            if cid:
                containers[alloc.key] = (cid, entry[1])
        holders: dict[int, list[Key]] = {}
        for h in held:
            for g in h.gpus:
                holders.setdefault(g.index, []).append(h.allocation.key)
        indexes = tuple(sorted(holders))
        pods = {h.allocation.pod_uid: h.pod for h in held}
        self._plan = plan = _Plan(version, tuple(held), indexes, containers, holders, pods)
        self.plans += 1
        return plan


def _standin(alloc: ContainerAllocation) -> Pod:
    """A pod the cache does not have yet, as far as its allocation tells: UID, namespace and name."""
    return {"metadata": {"uid": alloc.pod_uid, "namespace": alloc.namespace, "name": alloc.pod_name}}


def _init_states(pod: Pod) -> dict[str, str]:
    """Init container name -> its state (``waiting``, ``running``, ``terminated``) in the pod status;
    sidecars (``restartPolicy: Always``, they run beside the others) are left out."""
    spec = pod.get("spec") or {}
    inits = spec.get("initContainers") or [] if isinstance(spec, dict) else []
    states = {str(c.get("name", "")): "" for c in inits if isinstance(c, dict) and c.get("restartPolicy") != "Always"}
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    for status in statuses if isinstance(statuses, list) else []:
        if not isinstance(status, dict) or status.get("name") not in states:
            continue
        state = status.get("state") or {}
        states[str(status["name"])] = next(iter(state), "") if isinstance(state, dict) else ""
    return states


def _reported(found: list[tuple[ContainerAllocation, Pod]]) -> list[tuple[ContainerAllocation, Pod]]:
    """The allocations that have series: each share of a GPU once.

    The kubelet hands an init container's device IDs on to a later container of its pod asking for as
    many (the allocator's ``holding_same_ids``): both hold one share. Of the containers holding the
    same IDs on the same GPUs, the init container is reported while it runs, else the last of them in
    the order the kubelet allocates them (init containers, then the others). An init container that
    has terminated (not a sidecar) is left out whatever it held: it uses nothing any more.
    """
    states: dict[str, dict[str, str]] = {}
    groups: dict[tuple[str, frozenset[str], tuple[int, ...]], list[tuple[ContainerAllocation, Pod]]] = {}
    left_out: set[tuple[str, str]] = set()
    for alloc, pod in found:
        inits = states.get(alloc.pod_uid)
        if inits is None:
            inits = states[alloc.pod_uid] = _init_states(pod)
        if inits.get(alloc.container) == "terminated":
            left_out.add(alloc.key)
        elif alloc.device_ids:
            groups.setdefault((alloc.pod_uid, frozenset(alloc.device_ids), alloc.minors), []).append((alloc, pod))
    for holders in groups.values():
        if len(holders) == 1:
            continue
        inits = states[holders[0][0].pod_uid]
        running = [h for h in holders if inits.get(h[0].container) == "running"]
        if running:
            kept = running[0]
        else:
            order = _allocation_order(holders[0][1])
            kept = max(holders, key=lambda h: order.get(h[0].container, len(order)))
        left_out.update(h[0].key for h in holders if h is not kept)
    return [f for f in found if f[0].key not in left_out] if left_out else found


def _allocation_order(pod: Pod) -> dict[str, int]:
    """Container name -> its place in the order the kubelet allocates them: init containers, then the others."""
    spec = pod.get("spec") or {}
    if not isinstance(spec, dict):
        return {}
    listed = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return {str(c.get("name", "")): i for i, c in enumerate(listed) if isinstance(c, dict)}
