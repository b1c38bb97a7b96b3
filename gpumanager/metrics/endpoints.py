"""What the display service and the HTTP endpoints answer: /graph, /usage, /healthz, /readyz.

``/healthz`` (liveness) says whether the process and its loops are alive.
``/readyz`` (readiness) says whether Allocate can be served now: NVML answers,
both resources are registered with the kubelet, the pod cache is synced, the
interceptor is there in share mode, and the checkpoint can be written. Its
body names everything that is missing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpumanager.api import display_pb2
from gpumanager.device import nvml
from gpumanager.device.types import GPUInfo
from gpumanager.device.usage import gpu_usage
from gpumanager.metrics.bounded import NVML, NVMLReads
from gpumanager.metrics.containers import usage_response
from gpumanager.metrics.usage import ContainerUsage

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator
    from gpumanager.allocation.check import AllocationCheck
    from gpumanager.config import Config
    from gpumanager.device.health import HealthMonitor
    from gpumanager.deviceplugin.manager import PluginManager
    from gpumanager.dra.mode import DRAMode
    from gpumanager.kube.connection import ApiConnection
    from gpumanager.kube.podsource import PodSourceProxy
    from gpumanager.volume.keeper import MirrorKeeper

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


class ProbedAgent(Protocol):
    """What the probes read from the agent (each time they are asked: components come up later)."""

    config: Config
    gpus: list[GPUInfo]
    health: HealthMonitor | None
    plugins: PluginManager | None
    dra: DRAMode | None
    api: ApiConnection | None
    check: AllocationCheck | None
    allocator: Allocator | None
    mirror: MirrorKeeper | None
    pods: PodSourceProxy
    ready: threading.Event
    component_errors: dict[str, str]


def agent_probes(agent: ProbedAgent) -> Probes:
    """/healthz and /readyz of the agent: its loops, what Allocate needs, and a summary of its state."""
    return Probes(alive=_liveness(agent), ready=_readiness(agent), details=lambda: _details(agent))


def _liveness(agent: ProbedAgent) -> dict[str, Callable[[], bool]]:
    """The loops /healthz checks (the kubelet watch and GPU health only where they were started)."""
    loops: dict[str, Callable[[], bool]] = {}
    if agent.plugins is not None:
        loops["kubelet-watch"] = agent.plugins.alive
    loops["dra-sockets"] = lambda: agent.dra is None or agent.dra.sockets.alive()
    if agent.health is not None:
        loops["gpu-health"] = agent.health.alive
    loops["api-server-loops"] = lambda: agent.api is None or agent.api.alive()
    # Not judged before it starts (the agent is ready for Allocate a moment before its loops start).
    loops["allocation-check"] = lambda: agent.check is None or not agent.check.started() or agent.check.alive()
    return loops


def _readiness(agent: ProbedAgent) -> dict[str, Check]:
    """What /readyz checks: what Allocate (or DRA mode) needs now."""
    cfg_mode = agent.config.mode

    def registered() -> str:
        if agent.config.mode == "dra":
            problem = agent.component_errors.get("dra", "")  # DRA mode could not start (it says why)
            if problem:
                return problem
            return agent.dra.not_ready() if agent.dra is not None else "DRA mode is not serving yet"
        if agent.plugins is None or not agent.plugins.status.registered:
            reason = agent.plugins.status.last_error if agent.plugins else ""
            return "not registered with the kubelet" + (f": {reason}" if reason else "")
        return ""

    def pods_synced() -> str:
        if agent.pods.synced():
            return ""
        return agent.pods.reason or "the pod cache has not completed a list yet"

    def checkpoint() -> str:
        return agent.allocator.checkpoint_error if agent.allocator is not None else "not started"

    return {
        "nvml": lambda: agent.health.nvml_problem() if agent.health is not None else "not started",
        "registered": registered,
        "pod_cache": pods_synced,
        # Device-plugin shares mount the mirror's share-mode tree (DRA mode reports its own readiness).
        "interceptor": lambda: agent.mirror.share_problem if agent.mirror and cfg_mode != "dra" else "",
        "checkpoint": checkpoint,
        # The background start ended early (an unexpected error): what it did not start is missing.
        "start": lambda: agent.component_errors.get("start", ""),
    }


def _details(agent: ProbedAgent) -> dict[str, object]:
    """The summary both probes' bodies carry: registration, GPUs, pods, allocations, component errors."""
    health = agent.health
    unhealthy = [i for i, s in (health.snapshot() if health else {}).items() if not s.healthy]
    detail: dict[str, object] = {
        "registered": agent.plugins is not None and agent.plugins.status.registered,
        "gpus": len(agent.gpus),
        "unhealthy_gpus": unhealthy,
        "pods_synced": agent.pods.synced(),
        "allocations": len(agent.allocator.allocations()) if agent.allocator else 0,
        "errors": dict(agent.component_errors),
    }
    if agent.dra is not None:
        detail.update(agent.dra.healthz())
    return detail


class DisplayData:
    """PrintGraph and PrintUsages: the topology tree with NVML's processes, and per-container usage."""

    def __init__(
        self,
        gpus: Sequence[GPUInfo],
        graph: Callable[[Mapping[int, tuple[Sequence[int], int]]], str],
        sample: Callable[[], list[ContainerUsage]],
        nvml: NVMLReads = NVML,
    ) -> None:
        self._gpus = list(gpus)
        self._nvml = nvml
        self._graph = graph
        self._sample = sample

    def graph_text(self) -> str:
        """The tree in gpu-manager's PrintGraph format, processes and memory refreshed from NVML."""
        gpus = list(self._gpus)

        def read(index: int) -> tuple[Sequence[int], int] | None:
            try:
                usage = gpu_usage(index)
            except nvml.NVMLError as exc:
                log.debug("GPU %d usage unavailable: %s", index, exc)
                return None
            return usage.pids, usage.used_memory

        # A GPU NVML does not answer for is shown without processes (as a lost GPU is).
        read_now = self._nvml.per_gpu([g.index for g in gpus], read)
        return self._graph({index: usage for index, usage in read_now.items() if usage is not None})

    def usages(self) -> display_pb2.UsageResponse:
        """PrintUsages / GET /usage."""
        return usage_response(self._sample())
