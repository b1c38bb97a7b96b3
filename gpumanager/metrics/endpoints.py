"""What the display service and the HTTP endpoints answer: /graph, /usage, /healthz, /readyz.

``/healthz`` (liveness) says whether the process and its loops are alive.
``/readyz`` (readiness) says whether Allocate can be served now: NVML answers,
both resources are registered with the kubelet, the pod cache is synced, the
interceptor is there in share mode, and the checkpoint can be written. Its
body names everything that is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpumanager.api import display_pb2
from gpumanager.device import nvml
from gpumanager.device.types import GPUInfo
from gpumanager.device.usage import gpu_usage
from gpumanager.metrics.containers import usage_response
from gpumanager.metrics.usage import ContainerUsage

log = logging.getLogger(__name__)

Check = Callable[[], str]  # '' when fine, else what is wrong


@dataclass
class Probes:
    """Named checks: liveness ones (a loop is alive) and readiness ones (what Allocate needs)."""

    alive: Mapping[str, Callable[[], bool]]
    ready: Mapping[str, Check]
    details: Callable[[], dict[str, object]]

    def healthz(self) -> tuple[bool, dict[str, object]]:
        """(alive, body): every loop named in ``alive`` runs."""
        dead = sorted(name for name, check in self.alive.items() if not _safe_bool(check))
        return not dead, {"dead_loops": dead, **self.details()}

    def readyz(self) -> tuple[bool, dict[str, object]]:
        """(ready, body): ``missing`` names each unmet condition and why."""
        missing = {}
        for name, check in self.ready.items():
            try:
                problem = check()
            except Exception as exc:
                problem = f"check failed: {exc}"
            if problem:
                missing[name] = problem
        return not missing, {"ready": not missing, "missing": missing, **self.details()}


def _safe_bool(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        log.exception("liveness check failed")
        return False


class DisplayData:
    """PrintGraph and PrintUsages: the topology tree with NVML's processes, and per-container usage."""

    def __init__(
        self,
        gpus: Sequence[GPUInfo],
        graph: Callable[[Mapping[int, tuple[Sequence[int], int]]], str],
        sample: Callable[[], list[ContainerUsage]],
    ) -> None:
        self._gpus = list(gpus)
        self._graph = graph
        self._sample = sample

    def graph_text(self) -> str:
        """The tree in gpu-manager's PrintGraph format, processes and memory refreshed from NVML."""
        usages: dict[int, tuple[Sequence[int], int]] = {}
        for g in self._gpus:
            try:
                usage = gpu_usage(g.index)
            except nvml.NVMLError as exc:
                log.debug("GPU %d usage unavailable: %s", g.index, exc)
                continue
            usages[g.index] = (usage.pids, usage.used_memory)
        return self._graph(usages)

    def usages(self) -> display_pb2.UsageResponse:
        """PrintUsages / GET /usage."""
        return usage_response(self._sample())
