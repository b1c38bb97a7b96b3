"""Per-GPU usage from NVML: the compute processes on a GPU and the device memory they use."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pynvml

from gpumanager.device import nvml

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPUUsage:
    """Processes and used memory (bytes) of one GPU."""

    pids: tuple[int, ...]
    used_memory: int


def gpu_usage(index: int) -> GPUUsage:
    """The compute processes NVML reports on GPU ``index`` (host PIDs, ascending) and their memory.

    Raises pynvml.NVMLError when the GPU cannot be queried (lost, or NVML gone).
    """
    handle = nvml.handle(index)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    pids = tuple(sorted(int(p.pid) for p in procs))
    # usedGpuMemory is None when the driver cannot tell (e.g. without permission).
    used = sum(int(p.usedGpuMemory or 0) for p in procs)
    return GPUUsage(pids=pids, used_memory=used)


def running_pids(index: int) -> tuple[int, ...]:
    """Every process NVML lists on GPU ``index``: its compute and its graphics processes, ascending, a PID listed in
    both once. A 0 stands for each process NVML shows without its PID (a driver that translates PIDs into the
    caller's PID namespace shows so the processes of namespaces the agent does not see). A GPU or driver that
    cannot list graphics processes (NOT_SUPPORTED, or a driver without the call) gives its compute
    processes.

    Raises pynvml.NVMLError when the GPU cannot be queried (lost, or NVML gone).
    """
    handle = nvml.handle(index)
    procs = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    try:
        procs.extend(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
    except pynvml.NVMLError as exc:
        if exc.value not in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            raise
    pids = [int(p.pid) for p in procs]
    return (0,) * sum(pid <= 0 for pid in pids) + tuple(sorted({pid for pid in pids if pid > 0}))
