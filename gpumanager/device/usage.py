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
