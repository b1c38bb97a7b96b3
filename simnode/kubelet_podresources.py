"""A kubelet PodResources v1 server (``/v1.PodResourcesLister``) for the kubelet simulator.

It answers ``List``, ``GetAllocatableResources`` and ``Get`` from a snapshot source (the
simulator), over a real gRPC unix socket, with the message shapes the kubelet produces:

* each device is reported as its own ``ContainerDevices`` entry (one device ID per entry);
* ``List``/``Get``: the entry's topology lists every NUMA node the device was recorded on at
  allocation time (none for devices without topology);
* ``GetAllocatableResources``: one entry per (healthy device, NUMA node), no topology for
  devices without one.

* the kubelet's rate limit on every call: a token bucket of ``qps`` tokens a second holding at
  most ``burst`` (kubelet: 100 and 10); a call without a token fails at once with
  ``ResourceExhausted: rejected by rate limit``. Every call is recorded (:attr:`PodResourcesServer.calls`).

* ``List``/``Get`` show a pod's app containers and sidecars (restartable init containers), never its
  other init containers, whose devices the kubelet holds all the same.

Not modelled: CPU/memory-manager fields, dynamic resources, and pods and containers that hold no devices
(the simulator only knows pods through their allocations).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import grpc

from gpumanager.api import podresources_v1_pb2 as _pr
from gpumanager.api import podresources_v1_pb2_grpc as _pr_grpc

pr: Any = _pr
pr_grpc: Any = _pr_grpc

logger = logging.getLogger(__name__)

#: The kubelet's PodResources rate limit (``podresources.DefaultQPS``, ``DefaultBurstTokens``).
DEFAULT_QPS = 100.0
DEFAULT_BURST = 10

GetMethod = Literal["enabled", "disabled", "absent"]
"""``Get`` as kubelets serve it: ``enabled`` (1.34 on, feature gate KubeletPodResourcesGet on by default),
``disabled`` (1.27 to 1.33: the gate off by default, every Get a plain error, code Unknown), ``absent``
(before 1.27: no such method, code Unimplemented)."""

__all__ = [
    "DEFAULT_BURST",
    "DEFAULT_QPS",
    "ContainerSnapshot",
    "DeviceSnapshot",
    "GetMethod",
    "PodResourcesCall",
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


@dataclass(frozen=True)
class PodResourcesCall:
    """One call the server received: method name, when (monotonic), and whether the rate limit let it in."""

    method: str
    at: float
    admitted: bool


class TokenBucket:
    """``golang.org/x/time/rate.Limiter.Allow``: ``qps`` tokens a second, at most ``burst`` saved; 0 qps: no limit."""

    def __init__(self, qps: float, burst: int) -> None:
        self._qps = qps
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Take a token if there is one."""
        if self._qps <= 0:
            return True
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._qps)
            self._last = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


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

    def __init__(
        self, source: PodResourcesSource, limiter: TokenBucket, calls: list[PodResourcesCall], get: GetMethod
    ) -> None:
        self._get = get
        self._source = source
        self._limiter = limiter
        self._calls = calls
        # The last List answer and the snapshot it was made from (a source answers the same list while
        # nothing changed).
        self._list_made: tuple[list[PodSnapshot], Any] | None = None
        self._messages: dict[int, tuple[PodSnapshot, Any]] = {}  # id(snapshot) -> (snapshot, message)

    def _admit(self, method: str, context: grpc.ServicerContext) -> None:
        admitted = self._limiter.allow()
        self._calls.append(PodResourcesCall(method, time.monotonic(), admitted))
        if not admitted:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._admit("List", context)
        pods = self._source.pod_resources_snapshot()
        made = self._list_made
        if made is not None and made[0] is pods:
            return made[1]  # the source's pods have not changed since: the same answer
        answer = pr.ListPodResourcesResponse(pod_resources=[self._message(p) for p in pods])
        self._list_made = (pods, answer)
        messages = self._messages
        if len(messages) > 2 * len(pods) + 64:
            self._messages = {id(p): messages[id(p)] for p in pods if id(p) in messages}
        return answer

    def _message(self, pod: PodSnapshot) -> Any:
        """The pod's message, made once for each snapshot object (a source keeps the snapshot of a pod
        that did not change)."""
        known = self._messages.get(id(pod))
        if known is None or known[0] is not pod:
            known = self._messages[id(pod)] = (pod, _pod_message(pod))
        return known[1]

    def GetAllocatableResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._admit("GetAllocatableResources", context)
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
        if self._get == "absent":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method Get for service v1.PodResourcesLister")
        self._admit("Get", context)
        if self._get == "disabled":
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        for pod in self._source.pod_resources_snapshot(request.pod_namespace, request.pod_name):
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=_pod_message(pod))
        # A plain Go error in the kubelet: code Unknown.
        context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )


class PodResourcesServer:
    """Serves ``v1.PodResourcesLister`` on a unix socket until :meth:`stop`."""

    def __init__(
        self,
        socket_path: Path,
        source: PodResourcesSource,
        *,
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
        calls: list[PodResourcesCall] | None = None,
        get: GetMethod = "enabled",
    ) -> None:
        self.socket_path = Path(socket_path)
        self.get = get
        self._source = source
        self._limiter = TokenBucket(qps, burst)
        #: Every call received, in order (appending to a list is atomic under the GIL).
        self.calls: list[PodResourcesCall] = calls if calls is not None else []
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
        # The kubelet serves each call on a goroutine of its own: no small pool to queue behind.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="podresources"))
        pr_grpc.add_PodResourcesListerServicer_to_server(
            _Servicer(self._source, self._limiter, self.calls, self.get), server
        )
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        logger.info("pod-resources server listening on %s", self.socket_path)

    def stop(self) -> None:
        """Stop serving (the socket file is removed by gRPC)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=None).wait()
