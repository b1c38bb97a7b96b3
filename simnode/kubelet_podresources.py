"""A kubelet PodResources v1 server (``/v1.PodResourcesLister``) for the kubelet simulator.

It answers ``List``, ``GetAllocatableResources`` and ``Get`` from a snapshot source (the
simulator), over a real gRPC unix socket, with the message shapes the kubelet produces:

* each device is reported as its own ``ContainerDevices`` entry (one device ID per entry);
* ``List``/``Get``: the entry's topology lists every NUMA node the device was recorded on at
  allocation time (none for devices without topology);
* ``GetAllocatableResources``: one entry per (healthy device, NUMA node), no topology for
  devices without one.

Not modelled: the kubelet's rate limiter, CPU/memory-manager fields, dynamic resources, and pods
that hold no devices (the simulator only knows pods through their allocations).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from gpumanager.api import podresources_v1_pb2 as _pr
from gpumanager.api import podresources_v1_pb2_grpc as _pr_grpc

pr: Any = _pr
pr_grpc: Any = _pr_grpc

logger = logging.getLogger(__name__)

__all__ = [
    "ContainerSnapshot",
    "DeviceSnapshot",
    "PodResourcesServer",
    "PodResourcesSource",
    "PodSnapshot",
]


@dataclass(frozen=True)
class DeviceSnapshot:
    """One device of one resource, with the NUMA nodes it sits on (empty: no topology)."""

    resource: str
    device_id: str
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ContainerSnapshot:
    """A container and the devices assigned to it."""

    name: str
    devices: tuple[DeviceSnapshot, ...] = ()


@dataclass(frozen=True)
class PodSnapshot:
    """A pod known to the simulator (through its allocations)."""

    uid: str
    name: str
    namespace: str
    containers: tuple[ContainerSnapshot, ...] = field(default_factory=tuple)


class PodResourcesSource(Protocol):
    """What the server needs from the simulator."""

    def pod_resources_snapshot(self, namespace: str | None = None, name: str | None = None) -> list[PodSnapshot]:
        """All pods with their containers' devices (only the named pod when a name is given)."""
        ...

    def allocatable_snapshot(self) -> list[DeviceSnapshot]:
        """All healthy devices of every registered resource."""
        ...


def _topology(nodes: Sequence[int]) -> Any:
    real = [n for n in nodes if n >= 0]
    if not real:
        return None
    return pr.TopologyInfo(nodes=[pr.NUMANode(ID=n) for n in real])


def _pod_message(pod: PodSnapshot) -> Any:
    containers = []
    for c in pod.containers:
        devs = []
        for d in c.devices:
            topo = _topology(d.numa_nodes)
            kwargs: dict[str, Any] = {"resource_name": d.resource, "device_ids": [d.device_id]}
            if topo is not None:
                kwargs["topology"] = topo
            devs.append(pr.ContainerDevices(**kwargs))
        containers.append(pr.ContainerResources(name=c.name, devices=devs))
    return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)


class _Servicer:
    """Duck-typed ``PodResourcesListerServicer``."""

    def __init__(self, source: PodResourcesSource) -> None:
        self._source = source

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        pods = self._source.pod_resources_snapshot()
        return pr.ListPodResourcesResponse(pod_resources=[_pod_message(p) for p in pods])

    def GetAllocatableResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        out = []
        for d in self._source.allocatable_snapshot():
            real = [n for n in d.numa_nodes if n >= 0]
            if not real:
                out.append(pr.ContainerDevices(resource_name=d.resource, device_ids=[d.device_id]))
                continue
            for n in real:
                out.append(
                    pr.ContainerDevices(
                        resource_name=d.resource,
                        device_ids=[d.device_id],
                        topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=n)]),
                    )
                )
        return pr.AllocatableResourcesResponse(devices=out)

    def Get(self, request: Any, context: grpc.ServicerContext) -> Any:
        for pod in self._source.pod_resources_snapshot(request.pod_namespace, request.pod_name):
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=_pod_message(pod))
        context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )


class PodResourcesServer:
    """Serves ``v1.PodResourcesLister`` on a unix socket until :meth:`stop`."""

    def __init__(self, socket_path: Path, source: PodResourcesSource) -> None:
        self.socket_path = Path(socket_path)
        self._source = source
        self._server: grpc.Server | None = None

    def start(self) -> None:
        """Create the socket (removing a stale one) and start serving."""
        if self._server is not None:
            return
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="podresources"))
        pr_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self._source), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        logger.info("pod-resources server listening on %s", self.socket_path)

    def stop(self) -> None:
        """Stop serving (the socket file is removed by gRPC)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=None).wait()
