"""Client of the kubelet's PodResources v1 API: which pod and container hold given device IDs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpumanager.api import podresources_v1_pb2 as pb
from gpumanager.api import podresources_v1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class PodResourcesUnavailableError(RuntimeError):
    """The PodResources socket is missing or does not answer."""


@dataclass(frozen=True)
class ContainerDevices:
    """Device IDs of one resource held by one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesClient:
    """Asks the kubelet (``/var/lib/kubelet/pod-resources/kubelet.sock``); one call per question."""

    def __init__(self, socket_path: Path, *, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self._timeout = timeout

    def list(self) -> list[ContainerDevices]:
        """Every container's devices, as the kubelet sees them now."""
        if not self.socket_path.exists():
            raise PodResourcesUnavailableError(f"PodResources socket {self.socket_path} does not exist")
        with grpc.insecure_channel(f"unix://{self.socket_path}") as channel:
            try:
                reply = pb_grpc.PodResourcesListerStub(channel).List(
                    pb.ListPodResourcesRequest(), timeout=self._timeout
                )
            except grpc.RpcError as exc:
                raise PodResourcesUnavailableError(
                    f"PodResources List on {self.socket_path} failed: {exc.code().name}: {exc.details()}"
                ) from exc
        out = []
        for pod in reply.pod_resources:
            for container in pod.containers:
                for dev in container.devices:
                    out.append(
                        ContainerDevices(
                            namespace=pod.namespace,
                            pod=pod.name,
                            container=container.name,
                            resource=dev.resource_name,
                            device_ids=tuple(dev.device_ids),
                        )
                    )
        return out

    def owner_of(self, resource: str, device_ids: Sequence[str]) -> tuple[str, str, str] | None:
        """(namespace, pod name, container) holding exactly ``device_ids`` of ``resource``."""
        wanted = frozenset(device_ids)
        for entry in self.list():
            if entry.resource == resource and frozenset(entry.device_ids) == wanted:
                return (entry.namespace, entry.pod, entry.container)
        return None
