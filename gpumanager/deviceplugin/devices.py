"""Fake device IDs advertised to the kubelet, and the GPU each one belongs to.

IDs keep gpu-manager's prefixes (``tencent.com/vcuda-core-<n>``,
``tencent.com/vcuda-memory-268435456-<n>``) but are numbered in per-GPU ranges:
GPU g owns core IDs 100g .. 100g+99 and a contiguous run of
floor(memory / 256 MiB) memory IDs, so every ID names its GPU, and the GPU's
health and NUMA node can be reported per device.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpumanager import names
from gpumanager.allocation import ids as device_ids
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo


class UnknownDeviceError(ValueError):
    """A device ID that this node never advertised."""


@dataclass(frozen=True)
class _Range:
    gpu: int
    start: int
    count: int


class DeviceLayout:
    """The mapping between fake device IDs and GPUs for both resources."""

    def __init__(self, gpus: Sequence[GPUInfo]) -> None:
        self._gpus = list(gpus)
        self._core: list[_Range] = []
        self._memory: list[_Range] = []
        mem_start = 0
        for g in self._gpus:
            self._core.append(_Range(g.index, g.index * names.HUNDRED_CORES, names.HUNDRED_CORES))
            blocks = g.memory_total // names.MEMORY_BLOCK_BYTES
            self._memory.append(_Range(g.index, mem_start, blocks))
            mem_start += blocks
        self._mem_starts = [r.start for r in self._memory]

    @functools.cached_property
    def _positions(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Per resource, ID -> (GPU, ID number): Allocate and GetPreferredAllocation map thousands of IDs
        per call. Built at the first lookup, not on the way to registering with the kubelet; the one
        table for both (a table per question held each ID's string twice: 0.4 MiB on 8 x H100)."""
        return {
            resource: {
                f"{self.prefix(resource)}{n}": (r.gpu, n)
                for r in self._ranges(resource)
                for n in range(r.start, r.start + r.count)
            }
            for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)
        }

    @functools.cached_property
    def _ids_by_gpu(self) -> dict[str, dict[int, tuple[tuple[str, ...], frozenset[str]]]]:
        """Per resource and GPU index: its IDs in number order, and the same as a set; the strings are
        those of :attr:`_positions` (their hashes are kept: looking one up costs no hashing)."""
        out: dict[str, dict[int, tuple[tuple[str, ...], frozenset[str]]]] = {}
        for resource, positions in self._positions.items():
            per_gpu: dict[int, list[str]] = {}
            for device_id, (gpu, _number) in positions.items():  # built in number order
                per_gpu.setdefault(gpu, []).append(device_id)
            out[resource] = {gpu: (tuple(ids), frozenset(ids)) for gpu, ids in sorted(per_gpu.items())}
        return out

    def ids_by_gpu(self, resource: str) -> Mapping[int, tuple[tuple[str, ...], frozenset[str]]]:
        """Every GPU's IDs of ``resource`` by GPU index: in number order, and the same as a set."""
        return self._ids_by_gpu[resource]

    def positions(self, resource: str) -> Mapping[str, tuple[int, int]]:
        """Every device ID of ``resource`` -> (its GPU, its number): what an ID means, in one lookup."""
        return self._positions[resource]

    @staticmethod
    def prefix(resource: str) -> str:
        """The ID prefix of a resource."""
        if resource == names.VCORE_RESOURCE:
            return names.VCORE_ID_PREFIX
        if resource == names.VMEMORY_RESOURCE:
            return names.VMEMORY_ID_PREFIX
        raise ValueError(f"unknown resource {resource!r}")

    def _ranges(self, resource: str) -> list[_Range]:
        return self._core if resource == names.VCORE_RESOURCE else self._memory

    def id_range(self, resource: str, gpu: int) -> tuple[str, int, int]:
        """(prefix, first number, count): GPU ``gpu``'s IDs of ``resource`` are prefix+first .. prefix+first+count-1."""
        r = self._ranges(resource)[gpu]
        return self.prefix(resource), r.start, r.count

    def ids_of_gpu(self, resource: str, gpu: int) -> list[str]:
        """Every device ID of ``resource`` that belongs to GPU ``gpu``."""
        prefix = self.prefix(resource)
        r = self._ranges(resource)[gpu]
        return [f"{prefix}{n}" for n in range(r.start, r.start + r.count)]

    def count(self, resource: str) -> int:
        """How many devices of ``resource`` the node advertises."""
        return sum(r.count for r in self._ranges(resource))

    def gpu_of(self, resource: str, device_id: str) -> int:
        """The GPU index a device ID belongs to; UnknownDeviceError names a foreign ID."""
        prefix = self.prefix(resource)
        if device_id.startswith(prefix):
            known = self._positions[resource].get(device_id)
            if known is not None:
                return known[0]
        number = device_ids.tail_number(device_id[len(prefix) :]) if device_id.startswith(prefix) else None
        if number is None:
            raise UnknownDeviceError(f"device ID {device_ids.brief(device_id)} is not a {resource} device of this node")
        if resource == names.VCORE_RESOURCE:
            gpu = number // names.HUNDRED_CORES
            if gpu < len(self._core):
                return gpu
        else:
            pos = bisect.bisect_right(self._mem_starts, number) - 1
            if pos >= 0 and number < self._memory[pos].start + self._memory[pos].count:
                return self._memory[pos].gpu
        raise UnknownDeviceError(
            f"device ID {device_ids.brief(device_id)} is past the last {resource} device of this node"
        )

    def group_by_gpu(self, resource: str, device_ids: Iterable[str]) -> dict[int, list[str]]:
        """Split device IDs by GPU (raises UnknownDeviceError on a foreign ID)."""
        grouped: dict[int, list[str]] = {}
        for device_id in device_ids:
            grouped.setdefault(self.gpu_of(resource, device_id), []).append(device_id)
        return grouped

    def devices(self, resource: str, healthy: Mapping[int, bool]) -> list[pb.Device]:
        """The ListAndWatch device list of ``resource``; a GPU missing from ``healthy`` counts as healthy."""
        out = []
        for g in self._gpus:
            out.extend(self.devices_of_gpu(resource, g.index, healthy=healthy.get(g.index, True)))
        return out

    def devices_of_gpu(self, resource: str, gpu: int, *, healthy: bool) -> list[pb.Device]:
        """One GPU's devices of ``resource`` in the given health, with its NUMA node."""
        info = self._gpus[gpu]
        health = names.HEALTHY if healthy else names.UNHEALTHY
        topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=info.numa_node)]) if info.numa_node is not None else None
        return [pb.Device(ID=i, health=health, topology=topology) for i in self.ids_of_gpu(resource, gpu)]
