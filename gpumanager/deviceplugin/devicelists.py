"""ListAndWatch answers prepared before they are needed.

A node's device lists are large (16 x H200: 1,600 vcuda-core and 8,976
vcuda-memory devices); building thousands of messages when a GPU turns
unhealthy would delay the news by many milliseconds. So every GPU's devices
are encoded once per resource and health state at start; a health change only
joins prepared bytes (a ``repeated`` protobuf field is the concatenation of its
elements), and ListAndWatch sends them as they are.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout

RESOURCES = (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)


class DeviceLists:
    """Encoded ``ListAndWatchResponse`` of each resource for the current health of every GPU."""

    def __init__(self, layout: DeviceLayout, gpus: Sequence[GPUInfo], unhealthy: Sequence[int] = ()) -> None:
        self._gpus = [g.index for g in gpus]
        self._lock = threading.Lock()
        # resource -> GPU -> (bytes when healthy, bytes when unhealthy)
        self._chunks: dict[str, dict[int, tuple[bytes, bytes]]] = {}
        for resource in RESOURCES:
            per_gpu = {}
            for g in self._gpus:
                healthy = layout.devices_of_gpu(resource, g, healthy=True)
                sick = layout.devices_of_gpu(resource, g, healthy=False)
                per_gpu[g] = (
                    pb.ListAndWatchResponse(devices=healthy).SerializeToString(),
                    pb.ListAndWatchResponse(devices=sick).SerializeToString(),
                )
            self._chunks[resource] = per_gpu
        self._unhealthy = frozenset(unhealthy)
        self._encoded = {r: self._join(r, self._unhealthy) for r in RESOURCES}

    def _join(self, resource: str, unhealthy: frozenset[int]) -> bytes:
        chunks = self._chunks[resource]
        return b"".join(chunks[g][1 if g in unhealthy else 0] for g in self._gpus)

    def set_healthy(self, index: int, healthy: bool) -> bool:
        """Record a GPU's health; True when the lists changed."""
        with self._lock:
            unhealthy = self._unhealthy - {index} if healthy else self._unhealthy | {index}
            if unhealthy == self._unhealthy:
                return False
            self._encoded = {r: self._join(r, unhealthy) for r in RESOURCES}
            self._unhealthy = unhealthy
            return True

    def encoded(self, resource: str) -> bytes:
        """The serialized ListAndWatchResponse of ``resource`` now."""
        return self._encoded[resource]

    def devices(self, resource: str) -> list[pb.Device]:
        """The same list as messages (for logs and tests)."""
        return list(pb.ListAndWatchResponse.FromString(self._encoded[resource]).devices)
