"""ListAndWatch answers prepared before they are needed.

A node's device lists are large (16 x H200: 1,600 vcuda-core and 8,976
vcuda-memory devices); building thousands of messages when a GPU turns
unhealthy would delay the news by many milliseconds. So every GPU's devices
are encoded once per resource and health state at start; a health change only
joins prepared bytes (a ``repeated`` protobuf field is the concatenation of its
elements), and ListAndWatch sends them as they are.

Encoding them is on the registration path, and a message object per device
costs about 50 ms on the 16 x H200 node: the devices of one GPU differ only in
their ID (field 1), so protobuf encodes the rest once (health and topology,
fields 2 and 3) and each device is its ID field followed by those bytes (fields
are written in number order, so this is exactly protobuf's own encoding).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout

RESOURCES = (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)


_DEVICES_TAG = b"\x0a"  # ListAndWatchResponse.devices: field 1, length-delimited
_ID_TAG = b"\x0a"  # Device.ID: field 1, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _encode(prefix: str, first: int, count: int, numa_node: int | None) -> tuple[bytes, bytes]:
    """The ``devices`` field of a ListAndWatchResponse with a Device for each ID ``prefix<n>``, n in
    [first, first+count), encoded healthy and unhealthy."""
    topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=numa_node)]) if numa_node is not None else None
    raw_prefix = prefix.encode()
    # Numbers with the same count of digits share everything but the digits: each device is
    # head + digits + rest, so a run of them is head + (rest + head).join(digits) + rest (joined as
    # latin-1 text, which maps every byte to itself: no Python loop over the devices).
    runs: list[tuple[int, list[str]]] = []  # (digit count, the numbers as text)
    n, end = first, first + count
    while n < end:
        width = len(str(n))
        run_end = min(end, 10**width)
        runs.append((width, list(map(str, range(n, run_end)))))
        n = run_end
    out = []
    for health in (names.HEALTHY, names.UNHEALTHY):
        rest = pb.Device(health=health, topology=topology).SerializeToString()
        parts: list[bytes] = []
        for width, digits in runs:
            id_len = len(raw_prefix) + width
            id_field_len = len(_ID_TAG) + len(_varint(id_len)) + id_len
            head = _DEVICES_TAG + _varint(id_field_len + len(rest)) + _ID_TAG + _varint(id_len) + raw_prefix
            parts += (head, (rest + head).decode("latin-1").join(digits).encode("latin-1"), rest)
        out.append(b"".join(parts))
    return out[0], out[1]


class DeviceLists:
    """Encoded ``ListAndWatchResponse`` of each resource for the current health of every GPU."""

    def __init__(self, layout: DeviceLayout, gpus: Sequence[GPUInfo], unhealthy: Sequence[int] = ()) -> None:
        self._gpus = [g.index for g in gpus]
        gpus_by_index = {g.index: g for g in gpus}
        self._lock = threading.Lock()
        # resource -> GPU -> (bytes when healthy, bytes when unhealthy)
        self._chunks: dict[str, dict[int, tuple[bytes, bytes]]] = {}
        for resource in RESOURCES:
            per_gpu = {}
            for g in self._gpus:
                per_gpu[g] = _encode(*layout.id_range(resource, g), gpus_by_index[g].numa_node)
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
